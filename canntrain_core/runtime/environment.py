"""What each rank runs on, and one line when the ranks of a job do not agree.

A node whose ``import torch_npu`` fails (CANN missing or another version) computes on its CPU: alone, it trains
slowly without a word; in a job, its collectives hang or fail far from the cause. So at start every rank posts its
device type and its torch, torch_npu and CANN versions to the job's store, rank 0 compares them and posts a verdict,
and every rank raises the same one line when they differ (the cann-recipes-train articles' "rank 0 finds the
device, rank 1 does not"). The store, not a collective: ranks on different backends (hccl beside gloo) still meet
there. A recipe sized for a device (``distributed.target_device``) that finds another kind says so too.
"""

from __future__ import annotations

import json
import os
import socket
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from canntrain_core.errors import BadInput
from canntrain_core.sizing.devices import DEVICES
from canntrain_kernels.device import DEVICE_ENV

CANN_HOME = "/usr/local/Ascend/ascend-toolkit/latest"
_KEY = "canntrain/environment/{}"
_VERDICT = "canntrain/environment/verdict"
AGREE = ("device", "torch", "torch_npu", "CANN")  # what every rank of a job must share


def torch_npu_version() -> str:
    """torch_npu's version, 'not importable', or why its import failed (CANN libraries missing at load time)."""
    try:
        # deferred: optional (torch_npu)
        import torch_npu
    except ImportError:
        return "not importable"
    except Exception as e:  # OSError, RuntimeError, ... from the CANN libraries
        return f"import failed: {type(e).__name__}: {e}"
    return str(getattr(torch_npu, "__version__", "unknown"))


def cann_version() -> str:
    """The CANN toolkit's version from its ascend_toolkit_install.info ($ASCEND_TOOLKIT_HOME, then the default
    install path), or 'not found'."""
    for root in filter(None, (os.environ.get("ASCEND_TOOLKIT_HOME"), CANN_HOME)):
        for info in [
            Path(root) / "ascend_toolkit_install.info",
            *sorted(Path(root).glob("*/ascend_toolkit_install.info")),
        ]:
            if info.is_file():
                for line in info.read_text(errors="replace").splitlines():
                    if line.startswith("version="):
                        return f"{line.split('=', 1)[1].strip()} ({info})"
    return "not found"


def rank_environment(device_type: str) -> dict[str, str]:
    """This process's host, device type and versions."""
    return {
        "host": socket.gethostname(),
        "device": device_type,
        "torch": torch.__version__,
        "torch_npu": torch_npu_version(),
        "CANN": cann_version().split(" (")[0],
    }


def disagreement(found: list[dict[str, str]]) -> str | None:
    """One line naming the groups of ranks whose device or versions differ, or None when all agree."""
    groups: dict[tuple, list[int]] = {}
    for r, env in enumerate(found):
        groups.setdefault(tuple(env[k] for k in AGREE), []).append(r)
    if len(groups) == 1:
        return None
    differing = [k for i, k in enumerate(AGREE) if len({key[i] for key in groups}) > 1]
    parts = []
    for key, ranks in groups.items():
        hosts = sorted({found[r]["host"] for r in ranks})
        what = ", ".join(f"{k} {v}" for k, v in zip(AGREE, key) if k in differing)
        parts.append(f"{_ranks_text(ranks)} ({', '.join(hosts[:3])}{' ...' if len(hosts) > 3 else ''}): {what}")
    return (
        f"the ranks of this job disagree on {', '.join(differing)}: " + "; ".join(parts) + ". Every rank must see "
        "the same device and versions: run `canntrain doctor` on each node"
    )


def _ranks_text(ranks: list[int]) -> str:
    runs, start = [], ranks[0]
    for a, b in zip(ranks, ranks[1:] + [None]):
        if b != a + 1:
            runs.append(f"{start}" if start == a else f"{start}-{a}")
            start = b
    return ("rank " if len(ranks) == 1 else "ranks ") + ",".join(runs)


def check_ranks_agree(device_type: str, timeout: timedelta) -> None:
    """Raise BadInput, on every rank, when the job's ranks differ in device type or torch / torch_npu / CANN
    versions (see the module docstring). Nothing outside a process group of more than one rank."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    store = dist.distributed_c10d._get_default_store()  # (the watchdog's store too)
    me, world = dist.get_rank(), dist.get_world_size()
    store.set(_KEY.format(me), json.dumps(rank_environment(device_type)))
    if me == 0:
        keys = [_KEY.format(r) for r in range(world)]
        store.wait(keys, timeout)
        store.set(_VERDICT, disagreement([json.loads(store.get(k)) for k in keys]) or "")
    store.wait([_VERDICT], timeout)
    verdict = store.get(_VERDICT).decode()
    if verdict:
        raise BadInput(verdict)


def check_target_device(target: str | None, device_type: str) -> None:
    """A recipe sized for an NPU (or a GPU) that finds another kind of device here is refused, unless
    $CANNTRAIN_DEVICE names the one found (a rehearsal on purpose)."""
    if target is None:
        return
    spec = DEVICES[target.lower()]
    if spec.runtime == device_type or os.environ.get(DEVICE_ENV) == device_type:
        return
    why = f" (torch_npu: {torch_npu_version()})" if spec.runtime == "npu" else ""
    raise BadInput(
        f"distributed.target_device {target}: this process found no {spec.runtime.upper()}{why} and would train on "
        f"its {device_type}; set {DEVICE_ENV}={device_type} to do that on purpose, or leave target_device out"
    )
