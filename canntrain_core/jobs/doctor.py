"""`canntrain doctor RECIPE [--set KEY=VALUE]... [--timeout S] [--max-bytes N]`: check a job's environment, rank map
and collectives before training, launched exactly like the job (``torchrun --nproc_per_node K ... -m
canntrain_core.cli doctor RECIPE``); as a single process it reports the environment only.

For a job stuck at "waiting for the other ranks" the cann-recipes-train articles advise: check the rank map, give
multi-node jobs a master address every node reaches (not localhost), and run a communication test on every node.
Rank 0 prints, in order:

1. the environment: python, torch, torch_npu, CANN, the accelerator and the variables that steer the launch and
   HCCL/NCCL/gloo;
2. arrival, before any process group: each rank leaves its key in the launcher's store and rank 0 waits
   ``--timeout`` seconds for all of them; one that never came (the classic hang) is named, and the ranks that did
   come are told to stop instead of waiting for it;
3. the rank map (host, local rank, device of every rank) and its checks: the recipe's world size against the job's,
   local ranks 0..k-1 on each host, a reachable MASTER_ADDR on more than one node, the HCCL rank table if
   RANK_TABLE_FILE is set;
4. the recipe's mesh, and all_reduce / all_gather / all_to_all timed at growing sizes on the whole world and on each
   mesh dimension's groups (jobs/doctor_comm.py), each step behind a round that names a rank that did not reach it;
5. ``doctor: N problem(s)``, exit 0 with none.

``--delay-rank R --delay-seconds S`` makes rank R start S seconds late: a rehearsal of what a straggler looks like.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import platform
import socket
import time
from collections import Counter, defaultdict
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from canntrain_core.errors import BadInput, CanntrainError
from canntrain_core.jobs.doctor_cli import LAUNCH
from canntrain_core.jobs.doctor_comm import (
    ITERS,
    KEY,
    TIMING_HEADER,
    WARMUP,
    RankDidNotAnswer,
    arrive,
    communication,
    join_store,
    ranks_phrase,
    ranks_text,
    reach_round,
    timing_table,
)
from canntrain_core.recipe import load_recipe
from canntrain_core.runtime import get_accelerator
from canntrain_core.runtime.distributed import ParallelDims
from canntrain_core.runtime.environment import cann_version, disagreement, rank_environment, torch_npu_version
from canntrain_core.sizing.devices import bytes_text, parse_bytes

ENV_VARS = (  # what steers the launch, the rendezvous and HCCL / NCCL / gloo
    "MASTER_ADDR MASTER_PORT WORLD_SIZE RANK LOCAL_RANK LOCAL_WORLD_SIZE "
    "HCCL_CONNECT_TIMEOUT HCCL_EXEC_TIMEOUT HCCL_IF_IP HCCL_SOCKET_IFNAME HCCL_BUFFSIZE RANK_TABLE_FILE "
    "NCCL_SOCKET_IFNAME NCCL_IB_HCA NCCL_DEBUG GLOO_SOCKET_IFNAME TORCH_NCCL_ASYNC_ERROR_HANDLING "
    "ASCEND_RT_VISIBLE_DEVICES CUDA_VISIBLE_DEVICES"
).split()
LOOPBACK_NAMES = ("localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback")


class DoctorFoundProblems(CanntrainError):
    """The doctor's checks found problems; the report lists them all, the message names the first."""


# --------------------------------------------------------------------------- environment


def environment_rows(acc) -> list[list[str]]:
    capacity = acc.memory_capacity_bytes()
    memory = "unknown" if capacity is None else bytes_text(capacity) + (" (host)" if acc.type == "cpu" else "")
    rows = [
        ["python", platform.python_version()],
        ["torch", torch.__version__],
        ["torch_npu", torch_npu_version()],
        ["CANN", cann_version()],
        ["accelerator", f"{acc.type} ({acc.name()}), backend {acc.backend}"],
        ["devices", str(acc.device_count())],
        ["memory", memory],
    ]
    return rows + [[name, os.environ.get(name, "unset")] for name in ENV_VARS]


def table(header: list[str], rows: list[list[str]]) -> str:
    """Rows as aligned text under ``header``."""
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    lines = [header, *rows]
    return "\n".join("  " + "  ".join(str(c).ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines)


# --------------------------------------------------------------------------- rank map checks


def is_loopback(addr: str, resolve: bool = True) -> bool:
    """localhost, 127.x, ::1, or (``resolve``) a name that resolves only to those (Debian maps its hostname to
    127.0.1.1)."""
    a = addr.strip().strip("[]").lower()
    if a in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(a).is_loopback
    except ValueError:
        pass
    if not resolve:
        return False
    try:
        found = {info[4][0] for info in socket.getaddrinfo(a, None)}
    except OSError:
        return False  # this rank joined through it, so another node resolves it: nothing to say here
    return bool(found) and all(ipaddress.ip_address(ip.split("%")[0]).is_loopback for ip in found)


def world_problem(world: int, recipe, source: str, extra: int = 0) -> str | None:
    """The recipe's ``distributed.world_size`` (+ a stage's extra ranks) against the job's WORLD_SIZE."""
    want = recipe.distributed.world_size
    if world == want + extra:
        return None
    plus = f" + {extra} extra rank(s) of the stage (rlhf.scorer_ranks)" if extra else ""
    return (
        f"distributed.world_size={want}{plus} in {source} but this job has {world} process(es) (WORLD_SIZE): "
        f"launch with --nproc_per_node/--nnodes to match, or --set distributed.world_size={world - extra}"
    )


def local_rank_problems(rows: list[dict]) -> list[str]:
    """LOCAL_RANK 0..k-1 once each on every host, k = LOCAL_WORLD_SIZE; no device shared on a host."""
    problems = []
    by_host: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        by_host[r["host"]].append(r)
    for host, ranks in sorted(by_host.items()):
        local = sorted(r["local_rank"] for r in ranks)
        if local != list(range(len(local))):
            twice = sorted(k for k, n in Counter(local).items() if n > 1)
            why = (
                f" ({', '.join(map(str, twice))} twice: two nodes with one hostname, or two launches?)" if twice else ""
            )
            problems.append(f"host {host}: LOCAL_RANKs {local}, expected 0..{len(local) - 1} once each{why}")
        sizes = sorted({r["local_world"] for r in ranks})
        if sizes != [len(ranks)]:
            problems.append(f"host {host}: {len(ranks)} rank(s) but LOCAL_WORLD_SIZE {', '.join(map(str, sizes))}")
        devices = Counter(r["device"] for r in ranks if r["device"] != "cpu")
        for device, n in sorted(devices.items()):
            if n > 1:
                problems.append(f"host {host}: {n} ranks on {device} (ASCEND_RT_VISIBLE_DEVICES/CUDA_VISIBLE_DEVICES?)")
    return problems


def multi_node(rows: list[dict]) -> bool:
    return len({r["host"] for r in rows}) > 1 or any(len(rows) > r["local_world"] for r in rows)


def loopback_problems(rows: list[dict], resolve: bool = True) -> list[str]:
    """On more than one node, a MASTER_ADDR that is a loopback address reaches only the node it is on."""
    if not multi_node(rows):
        return []
    by_addr: dict[str, list[int]] = defaultdict(list)
    for r in rows:
        by_addr[r["master_addr"]].append(r["rank"])
    hosts = len({r["host"] for r in rows})
    return [
        f"MASTER_ADDR={addr} ({ranks_phrase(ranks)}) is a loopback address on a multi-node job ({hosts} host(s), "
        f"WORLD_SIZE {len(rows)} > LOCAL_WORLD_SIZE {rows[0]['local_world']}): the other nodes cannot reach it; use "
        "the master node's address on the cluster network (torchrun --master_addr / --rdzv_endpoint)"
        for addr, ranks in sorted(by_addr.items())
        if is_loopback(addr, resolve)
    ]


def rank_table_problems(path: str, world: int) -> list[str]:
    # deferred: start-up time (canntrain --help does not load runtime.rank_table)
    from canntrain_core.runtime.rank_table import RankTableError, check_rank_table, load_rank_table

    try:
        found = check_rank_table(load_rank_table(path), world)
    except RankTableError as e:
        found = e.problems
    return [f"RANK_TABLE_FILE {path}: {p}" for p in found]


def rank_map_problems(rows: list[dict], recipe, source: str, extra: int = 0) -> list[str]:
    problems = [p for p in [world_problem(len(rows), recipe, source, extra)] if p]
    problems += local_rank_problems(rows) + loopback_problems(rows)
    if all("environment" in r for r in rows):  # device type and versions, as the trainer checks at start
        problems += [p for p in [disagreement([r["environment"] for r in rows])] if p]
    if os.environ.get("RANK_TABLE_FILE"):
        problems += rank_table_problems(os.environ["RANK_TABLE_FILE"], len(rows))
    return problems


def my_row(acc, rank: int, world: int) -> dict:
    return {
        "rank": rank,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "local_rank": int(os.environ.get("LOCAL_RANK", "0")),
        "local_world": int(os.environ.get("LOCAL_WORLD_SIZE", str(world))),
        "device": str(acc.device),
        "master_addr": os.environ.get("MASTER_ADDR", "unset"),
        "environment": rank_environment(acc.type),
    }


def rank_map_table(rows: list[dict]) -> str:
    cells = [[str(r["rank"]), r["host"], str(r["pid"]), str(r["local_rank"]), r["device"]] for r in rows]
    return table(["rank", "host", "pid", "local rank", "device"], cells)


# --------------------------------------------------------------------------- the command


def _max_bytes(text: str | None, device_type: str) -> int:
    if text is None:
        return (4 if device_type == "cpu" else 256) * 1024**2
    try:
        value = int(parse_bytes(text))
    except ValueError:
        value = 0
    if value < 1:
        raise BadInput(f"--max-bytes {text!r}: expected a size such as 4MiB, 64MiB or 1048576")
    return value


def _check_args(args: argparse.Namespace, world: int) -> None:
    if args.timeout <= 0:
        raise BadInput(f"--timeout must be > 0 seconds, got {args.timeout:g}")
    if args.delay_rank is not None and not (0 <= args.delay_rank < world and args.delay_seconds > 0):
        raise BadInput(f"--delay-rank needs a rank of 0..{world - 1} and --delay-seconds > 0 (world size {world})")


def run(args: argparse.Namespace) -> int:
    # Under torchrun, @record writes an unexpected exception where the launcher's summary shows it.
    return record(_doctor)(args)


def _doctor(args: argparse.Namespace) -> int:
    launched = "WORLD_SIZE" in os.environ
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    _check_args(args, world)
    recipe = load_recipe(args.recipe, args.overrides)  # a bad recipe or --set fails here, before any waiting
    acc = get_accelerator()
    max_bytes = _max_bytes(args.max_bytes, acc.type)
    say = _printer(rank)
    say(f"environment (rank 0 on {socket.gethostname()})\n" + table(["what", "value"], environment_rows(acc)))
    if world == 1:
        return _single(say, acc, recipe, args.recipe, launched)
    return _distributed(say, acc, recipe, args, rank, world, max_bytes)


def _printer(rank: int):
    def say(text: str = "") -> None:
        if rank == 0:
            print(f"\n{text}" if text else "", flush=True)

    return say


def _extra_ranks(recipe) -> int:
    """A stage's ranks beyond distributed.world_size (PPO's separated placement); the stage table is asked only when
    the recipe separates anything."""
    if recipe.rlhf.device_placement != "separated":
        return 0
    # The stage table imports every stage, transformers' models with them (4 s of a rank's 6 s start here).
    # deferred: start-up time, paid only by a recipe that separates ranks
    from canntrain_core.stages import stage_of

    return stage_of(recipe).extra_ranks(recipe)


def _single(say, acc, recipe, source: str, launched: bool) -> int:
    extra = _extra_ranks(recipe)
    problems = rank_map_problems([my_row(acc, 0, 1)], recipe, source, extra) if launched else []
    want = recipe.distributed.world_size + extra
    say(
        "collectives: not tested (one process"
        + (f"; the recipe runs {want}" if want > 1 else "")
        + f"): launch the doctor exactly like the job, {LAUNCH}"
    )
    return _finish(say, problems)


def _start(say, acc, args, rank: int, world: int):
    """Join the launcher's store, wait for every rank (after the rehearsal's delay), then the process group."""
    acc.set_device()
    store = join_store(rank, args.timeout)
    if rank == args.delay_rank:
        print(f"doctor: rank {rank} starts {args.delay_seconds:g} s late (--delay-rank, a rehearsal)", flush=True)
        time.sleep(args.delay_seconds)
    waited = arrive(store, rank, world, args.timeout, _loopback_hint(world))
    say(f"arrival: {world} of {world} ranks in the store after {waited:.1f} s (rank 0's wait)")
    try:
        dist.init_process_group(
            backend=acc.backend,
            store=dist.PrefixStore(f"{KEY}/pg", store),
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=args.timeout),
        )
    except RuntimeError as e:
        raise RankDidNotAnswer(f"init_process_group({acc.backend}) on rank {rank} failed: {e}") from None
    return store


def _loopback_hint(world: int) -> str:
    """What the arrival's failure adds when this rank's MASTER_ADDR cannot be right (it runs before the rank map)."""
    addr = os.environ.get("MASTER_ADDR", "")
    if world > int(os.environ.get("LOCAL_WORLD_SIZE", str(world))) and is_loopback(addr):
        return f"MASTER_ADDR={addr} is a loopback address, which nodes other than the master's cannot reach"
    return ""


def _distributed(say, acc, recipe, args, rank: int, world: int, max_bytes: int) -> int:
    store = _start(say, acc, args, rank, world)
    reach_round(store, "rank map", rank, list(range(world)), args.timeout)
    rows: list = [None] * world
    dist.all_gather_object(rows, my_row(acc, rank, world))
    extra = _extra_ranks(recipe)
    problems = rank_map_problems(rows, recipe, args.recipe, extra)
    say(f"rank map ({len({r['host'] for r in rows})} host(s))\n" + rank_map_table(rows))

    mesh, dims = None, ParallelDims.from_recipe(recipe)
    if world != dims.world_size or extra:  # the recipe's mesh cannot be built on this job
        say(f"mesh: not built ({'the job is split: ' if extra else ''}the recipe's mesh holds {dims.world_size} ranks)")
    else:
        reach_round(store, "mesh", rank, list(range(world)), args.timeout)
        mesh = dims.build_mesh(acc.type)
        say("mesh: " + (" x ".join(f"{n} {s}" for n, s in dims.mesh_sizes()) or "none (every parallel size is 1)"))
    timings = communication(acc, store, rank, world, mesh, args.timeout, max_bytes)
    say(
        f"communication ({acc.backend}, float32; time: the slowest rank's mean of {ITERS} calls after {WARMUP} "
        "warm-up; bus bandwidth as nccl-tests: all_reduce x 2(n-1)/n, all_gather and all_to_all x (n-1)/n)\n"
        + table(TIMING_HEADER, timing_table(timings))
    )
    problems += [
        f"{t.op} on {t.group} (ranks {ranks_text(t.ranks)}) at {bytes_text(t.size)}: a rank got wrong values"
        for t in timings
        if t.wrong
    ]
    dist.destroy_process_group()
    return _finish(say, problems, rank)


def _finish(say, problems: list[str], rank: int = 0) -> int:
    """The summary; with problems rank 0 fails, which fails the job, and the other ranks end quietly so that the
    launcher's summary holds one line, not one per rank."""
    say(f"doctor: {len(problems)} problem(s)" + "".join(f"\n  - {p}" for p in problems))
    if problems and rank == 0:
        more = f" (and {len(problems) - 1} more in rank 0's report)" if len(problems) > 1 else ""
        raise DoctorFoundProblems(f"{len(problems)} problem(s): {problems[0]}{more}")
    return 0
