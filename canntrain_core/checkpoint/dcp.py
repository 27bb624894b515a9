"""Checkpoints written with torch.distributed.checkpoint (DCP), atomically and verifiably.

Layout of ``checkpoints/step_N/``::

    .metadata, __0_0.distcp ...   model + optimizer, DCP format (the same format serves sharded runs)
    trainer_state_rank{R}.pt      step, scheduler, sampler and RNG states of rank R
    recipe.resolved.yaml          the recipe that wrote it
    config.json, tokenizer.json   the model's transformers config and the tokenizer (for export)
    tokenizer_config.json, ...    its special tokens, chat template, generation config (when there are any)
    manifest.json                 size and sha256 of every file above; written last

Everything is written into ``checkpoints/.tmp-step_N-*`` and renamed into place only when
complete, so a crash mid-save leaves no ``step_N`` behind. A directory without a manifest,
or whose files do not match it, is reported and skipped by ``resume_from: auto``.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import yaml
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from canntrain_core.checkpoint.names import hf_name
from canntrain_core.errors import BadInput, CanntrainError
from canntrain_core.runtime.distributed import from_rank0, rank

MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")


def _save_tensors(state: dict, trainer_state: dict, tmp: Path) -> None:
    with single_process_ok():
        dcp.save(state, checkpoint_id=str(tmp))
    torch.save(trainer_state, tmp / f"trainer_state_rank{rank()}.pt")


def _write_files(tmp: Path, files: dict[str, str], step: int) -> None:
    for name, text in files.items():
        (tmp / name).parent.mkdir(parents=True, exist_ok=True)  # e.g. additional_chat_templates/
        (tmp / name).write_text(text, encoding="utf-8")
    _write_manifest(tmp, step)


def _writing(work) -> str | None:
    """Run ``work``; what stopped it writing (:func:`write_failure`), or None when it finished."""
    try:
        work()
    except BaseException as e:  # torch's CheckpointException is a BaseException
        failed = write_failure(e)
        if failed is None:
            raise
        return failed
    return None


def _first_of_all_ranks(failed: str | None) -> str | None:
    """Every rank learns whether any rank failed to write (a collective: every rank calls it)."""
    if not (dist.is_available() and dist.is_initialized()):
        return failed
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, failed)
    return next((f for f in everyone if f is not None), None)


def write_failure(e: BaseException) -> str | None:
    """What an OSError behind ``e`` (itself, its causes, or a rank's failure inside torch's CheckpointException)
    says about writing: 'the disk is full (ENOSPC)' and the like; None when there is none."""
    seen, todo = set(), [e]
    while todo:
        x = todo.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, OSError) and x.errno in _WRITE_ERRNOS:
            return f"{_WRITE_ERRNOS[x.errno]} ({errno.errorcode.get(x.errno, x.errno)})"
        todo += [x.__cause__, x.__context__]
        failures = getattr(x, "failures", None)
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
    return None


_WRITE_ERRNOS = {
    errno.ENOSPC: "the disk is full",
    errno.EDQUOT: "the disk quota is exceeded",
    errno.EROFS: "the file system is read-only",
    errno.EFBIG: "a file grew past the size limit",
}


def _free(path: Path) -> str:
    try:
        st = os.statvfs(path)
    except OSError:
        return "free space unknown"
    return f"{st.f_bavail * st.f_frsize / 2**20:.1f} MiB free there now"


class CheckpointWriteFailed(CanntrainError):
    """A checkpoint could not be written (disk full, quota, read-only): the half-written copy is removed, earlier
    checkpoints stay."""


class CheckpointError(BadInput, RuntimeError):
    """A checkpoint that is missing, incomplete or corrupt; the message names the path and file."""


@contextlib.contextmanager
def single_process_ok():
    """DCP warns when it runs without a process group; one process saving or loading is intended here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _options(trainable_only: bool):
    """State-dict options: everything, or (LoRA) only the parameters that train."""
    return StateDictOptions(ignore_frozen_params=True, strict=False) if trainable_only else None


def _model_state(model: torch.nn.Module, options) -> dict[str, Any]:
    """The model's state dict as ``options`` select it; with frozen parameters left out (LoRA), only what trains:
    a frozen layer's extra state (a 4-bit base's quantization constants) is rebuilt from ``model.init_from`` too."""
    state = get_model_state_dict(model, options=options)
    if options is not None and options.ignore_frozen_params:
        trainable = {hf_name(name) for name, p in model.named_parameters() if p.requires_grad}  # wrappers aside
        state = {k: v for k, v in state.items() if hf_name(k) in trainable}
    return state


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _write_manifest(directory: Path, step: int) -> None:
    files = {
        str(p.relative_to(directory)): {"bytes": p.stat().st_size, "sha256": _sha256(p)}
        for p in sorted(directory.rglob("*"))
        if p.is_file() and p.name != MANIFEST
    }
    tmp = directory / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps({"step": step, "files": files}, indent=1))
    os.replace(tmp, directory / MANIFEST)


def verify_checkpoint(path: str | Path) -> dict[str, Any]:
    """Check a checkpoint against its manifest; return the manifest or raise CheckpointError."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint directory")
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(f"{path}: incomplete checkpoint (no {MANIFEST}; the save did not finish)")
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
    except (ValueError, KeyError) as e:
        raise CheckpointError(f"{manifest_path}: unreadable manifest ({e})") from None
    for name, want in files.items():
        f = path / name
        if not f.is_file():
            raise CheckpointError(f"{path}: file {name} listed in the manifest is missing")
        if f.stat().st_size != want["bytes"]:
            raise CheckpointError(
                f"{path}: file {name} is {f.stat().st_size} bytes, the manifest says {want['bytes']} (truncated?)"
            )
        if _sha256(f) != want["sha256"]:
            raise CheckpointError(f"{path}: file {name} is corrupt (sha256 does not match the manifest)")
    return manifest


def checkpoint_recipe(path: str | Path) -> dict[str, Any]:
    """The recipe a checkpoint was written with, as a dict (its schema may be older than this one)."""
    f = Path(path) / "recipe.resolved.yaml"
    try:
        loaded = yaml.safe_load(f.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise CheckpointError(f"{f}: unreadable recipe ({e})") from None
    if not isinstance(loaded, dict):
        raise CheckpointError(f"{f}: not a recipe (got {type(loaded).__name__})")
    return loaded


def checkpoint_config(path: str | Path) -> dict[str, Any] | None:
    """The model's transformers config a checkpoint was written with (None for checkpoints older than that)."""
    f = Path(path) / "config.json"
    return json.loads(f.read_text()) if f.is_file() else None


def list_checkpoints(ckpt_root: str | Path) -> list[Path]:
    """step_N directories under ckpt_root, oldest first (complete or not)."""
    root = Path(ckpt_root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def find_resumable(ckpt_root: str | Path) -> tuple[Path | None, list[tuple[Path, CheckpointError]]]:
    """The newest checkpoint that verifies, and every damaged one newer than it (newest first)."""
    damaged = []
    for path in reversed(list_checkpoints(ckpt_root)):
        try:
            verify_checkpoint(path)
            return path, damaged
        except CheckpointError as e:
            damaged.append((path, e))
    return None, damaged


def complete_checkpoints(ckpt_root: str | Path) -> list[Path]:
    """The checkpoints whose save finished (the manifest is written last, then the directory renamed into place),
    oldest first, without reading their files: what a failing run names to resume from (resuming verifies it)."""
    return [p for p in list_checkpoints(ckpt_root) if (p / MANIFEST).is_file()]


def latest_checkpoint(ckpt_root: str | Path) -> Path | None:
    """The newest checkpoint that verifies; damaged ones are never picked."""
    return find_resumable(ckpt_root)[0]


def set_aside(path: str | Path) -> Path:
    """Rename a damaged checkpoint to ``step_N.damaged-<UTC time>`` beside it, so the run can write
    a fresh step_N; it is never deleted (it may be the only evidence of what went wrong), and
    neither listing, ``latest_checkpoint`` nor ``keep_last`` sees it again."""
    path = Path(path)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    target, n = path.with_name(f"{path.name}.damaged-{stamp}"), 1
    while target.exists():  # damaged twice within a second
        target, n = path.with_name(f"{path.name}.damaged-{stamp}-{n}"), n + 1
    os.rename(path, target)
    return target


def _remove(path: Path) -> None:
    """Delete a checkpoint so that a kill part-way leaves no step_N: renamed out of the listing first, as
    .tmp-..., which the next start removes (:func:`clean_interrupted`)."""
    gone = path.with_name(f".tmp-{path.name}-pruned")
    os.rename(path, gone)
    shutil.rmtree(gone, ignore_errors=True)


def clean_interrupted(ckpt_root: str | Path, keep_last: int) -> list[str]:
    """What interrupted saves and prunings left under ``ckpt_root``, cleaned before a run writes there (rank 0):
    ``.tmp-*`` directories (a killed save's, or a pruned checkpoint's) removed; a ``step_N`` without its manifest
    with ``keep_last`` complete checkpoints newer than it (a pruning killed inside its delete, as an older
    canntrain deleted in place) removed, as pruning would have; one with fewer set aside (never deleted:
    nothing here explains it). Returns one line per thing done."""
    root = Path(ckpt_root)
    if not root.is_dir():
        return []
    done = []
    for p in sorted(root.glob(".tmp-step_*")):  # never a checkpoint, and it holds disk space
        shutil.rmtree(p, ignore_errors=True)
        done.append(f"removed {p.name} (a save or pruning that was interrupted)")
    complete = [_step_of(p) for p in complete_checkpoints(root)]
    for p in list_checkpoints(root):
        newer = sum(1 for step in complete if step > _step_of(p))
        if (p / MANIFEST).is_file() or newer == 0:
            continue  # the newest incomplete ones are for resuming to find and set aside, naming why
        if newer >= keep_last:
            _remove(p)
            done.append(f"removed {p.name} (no manifest: a pruning under logging.keep_last was interrupted)")
        else:
            done.append(f"set {p.name} aside as {set_aside(p).name} (no manifest, older than a complete checkpoint)")
    return done


def _step_of(path: Path) -> int:
    return int(_STEP_DIR.match(path.name).group(1))


def save_checkpoint(
    ckpt_root: str | Path,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    trainer_state: dict[str, Any],
    files: dict[str, str],
    keep_last: int | None = None,
    trainable_only: bool = False,
) -> Path:
    """Write checkpoints/step_{step} atomically; keep only the newest ``keep_last``.

    ``files``: small text files rank 0 writes beside the tensors (the recipe, the model's
    config.json, the tokenizer), so the checkpoint alone can be resumed, checked and exported.
    """
    root = Path(ckpt_root)
    final = root / f"step_{step}"
    if final.exists():
        raise CheckpointError(
            f"{final} already exists (this run was resumed from an earlier checkpoint than the newest); "
            "refusing to overwrite it: move it away, or resume with --resume-from auto"
        )
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(from_rank0(tempfile.mkdtemp(prefix=f".tmp-step_{step}-", dir=root) if rank() == 0 else None))

    options = _options(trainable_only)
    state = {
        "model": _model_state(model, options),
        "optim": get_optimizer_state_dict(model, optimizer, options=options),
    }
    failed = _writing(lambda: _save_tensors(state, trainer_state, tmp))  # each rank its own shards and state
    failed = _first_of_all_ranks(failed)  # (also the barrier before rank 0 completes the directory)
    if failed is None and rank() == 0:
        failed = _writing(lambda: _write_files(tmp, files, step))
    failed = from_rank0(failed) or failed
    if failed is not None:
        if rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # a half-written checkpoint would keep the disk full
        raise CheckpointWriteFailed(
            f"checkpoint step_{step} could not be written under {root}: {failed} ({_free(root)}); the half-written "
            f"copy was removed and earlier checkpoints are as they were: free space (or raise logging.ckpt_interval, "
            "lower logging.keep_last) and resume with --resume-from auto"
        )
    if rank() == 0:
        os.rename(tmp, final)  # atomic on one file system: step_N appears complete or not at all
        if keep_last:
            # Only complete checkpoints count; damaged ones were renamed aside and are never deleted.
            for old in complete_checkpoints(root)[:-keep_last]:
                _remove(old)
    _barrier()
    return final


def load_checkpoint(
    path: str | Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    verify: bool = True,
    trainable_only: bool = False,
) -> dict[str, Any]:
    """Verify (unless the caller just did), then load model and optimizer in place; return this
    rank's trainer state. ``trainable_only``: the checkpoint holds the trainable parameters only (LoRA)."""
    path = Path(path)
    if verify:
        verify_checkpoint(path)
    options = _options(trainable_only)
    state = {
        "model": _model_state(model, options),
        "optim": get_optimizer_state_dict(model, optimizer, options=options),
    }
    with single_process_ok():
        dcp.load(state, checkpoint_id=str(path))
    set_model_state_dict(model, state["model"], options=options)
    set_optimizer_state_dict(model, optimizer, state["optim"], options=options)
    rank_file = path / f"trainer_state_rank{rank()}.pt"
    if not rank_file.is_file():
        rank_file = path / "trainer_state_rank0.pt"  # fewer ranks wrote it: rank 0's step, sampler and RNG states
    # Our own file, verified against the manifest above; it holds numpy RNG state, so not weights_only.
    return torch.load(rank_file, weights_only=False)


def load_model_weights(path: str | Path, model: torch.nn.Module, verify: bool = True) -> None:
    """Verify a checkpoint (unless the caller just did), then load only its model weights into ``model``
    (sharded or not; the optimizer states it also holds are not read): a reward model for PPO, say."""
    if verify:
        verify_checkpoint(path)
    state = {"model": get_model_state_dict(model)}
    with single_process_ok():
        dcp.load(state, checkpoint_id=str(path))
    set_model_state_dict(model, state["model"])
