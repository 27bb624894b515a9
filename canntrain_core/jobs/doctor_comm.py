"""`canntrain doctor`'s communication half: arrival and rounds through the launcher's store, timed collectives.

Before any process group, every rank leaves ``canntrain-doctor/arrived/<rank>`` in the store it rendezvoused on
(under torchrun the agent's, which outlives any worker) and rank 0 waits ``--timeout`` seconds for all of them, then
leaves a verdict the others wait for: go on, or stop, naming the ranks that never came.

After that, a rank that never answers makes every other rank wait inside a collective until the process group's
timeout, with nothing that says which rank it was. So each later step starts with a *round* through the same store:
every rank sets ``canntrain-doctor/round/<step>/<rank>`` and waits, at most ``--timeout`` seconds, for the keys of the
ranks it is about to talk to. A missing key names the rank that is stuck or gone, before any collective hangs on it.

The collectives are nccl-tests' three (all_reduce, all_gather, all_to_all) at growing sizes, each checked for the
right values once and then timed; their bandwidths follow nccl-tests' conventions: ``size`` is the bytes each rank
ends with, algorithm bandwidth ``size / time``, and bus bandwidth the algorithm bandwidth times the share of ``size``
a ring moves over each rank's link (:func:`bus_factor`), a figure that does not depend on the group's size.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from canntrain_core.errors import CanntrainError
from canntrain_core.sizing.devices import bytes_text

KEY = "canntrain-doctor"  # the store keys' prefix (the launcher's store also holds its own keys)
OPS = ("all_reduce", "all_gather", "all_to_all")
WARMUP, ITERS = 2, 5  # the first warm-up call is the one whose values are checked
FIRST_SIZE = 4 * 1024  # 4 KiB, then x4 up to --max-bytes
POLL_S = 0.05


class RankDidNotAnswer(CanntrainError):
    """A rank did not arrive, or did not reach a step of the doctor, within ``--timeout``: it is stuck or gone."""


def ranks_text(ranks: list[int]) -> str:
    """[0, 1, 2, 3] -> '0-3'; [0, 2, 4] -> '0,2,4'."""
    ranks = sorted(ranks)
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks))


def ranks_phrase(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def missing_keys(store, keys: dict[int, str], timeout: float) -> list[int]:
    """The ranks whose key is still not in ``store`` after waiting up to ``timeout`` seconds ([] once all are).

    One check of all the keys per poll, the polls further apart as the wait goes on (up to a second): a thousand
    ranks waiting stay a light load on the store. (``store.wait`` would block instead, but its timeout logs C++
    socket warnings on top of the one line this tool prints.)"""
    deadline, pause = time.monotonic() + timeout, POLL_S
    while not store.check(list(keys.values())):
        if time.monotonic() >= deadline:
            return sorted(r for r, k in keys.items() if not store.check([k]))
        time.sleep(min(pause, max(deadline - time.monotonic(), 0)))
        pause = min(pause * 2, 1.0)
    return []


def reach_round(store, step: str, rank: int, members: list[int], timeout: float) -> None:
    """Announce that ``rank`` reached ``step`` and wait for the other ``members``; raise naming those that did not."""
    key = f"{KEY}/round/{step}/"
    store.set(key + str(rank), "1")
    missing = missing_keys(store, {r: key + str(r) for r in members}, timeout)
    if missing:
        raise RankDidNotAnswer(
            f"{ranks_phrase(missing)} did not reach the {step} round within {timeout:g} s (rank {rank} waited): "
            "stuck or gone; its own log (torchrun's, the node's) says where"
        )


# --------------------------------------------------------------------------- arrival


def join_store(rank: int, timeout: float):
    """The store the launcher's ranks share (under torchrun: the agent's; each worker is a client of it)."""
    where = f"MASTER_ADDR:MASTER_PORT={os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
    try:
        store, _, _ = next(dist.rendezvous("env://", timeout=timedelta(seconds=timeout)))
    except (RuntimeError, ValueError) as e:
        raise RankDidNotAnswer(f"rank {rank} could not join the store at {where} within {timeout:g} s: {e}") from None
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    return dist.PrefixStore(f"restart{restart}", store) if restart else store  # a restart sees no stale keys


def _missing_message(store, missing: list[int], world: int, timeout: float, hint: str) -> str:
    arrived = [r for r in range(world) if r not in missing]
    hosts = sorted({store.get(f"{KEY}/arrived/{r}").decode().rsplit(":", 1)[0] for r in arrived})
    message = (
        f"{ranks_phrase(missing)} of {world} did not arrive within {timeout:g} s: never started or stuck before the "
        f"doctor ({len(arrived)} arrived, from {', '.join(hosts)}); read that node's launcher log and check it was "
        "launched with the same --nnodes, --nproc_per_node, --master_addr and --master_port"
    )
    return message + (f"; {hint}" if hint else "")


def arrive(store, rank: int, world: int, timeout: float, hint: str = "") -> float:
    """Leave this rank's key; rank 0 waits for everyone's and tells the others to go on or stop (``hint``: what the
    failure adds). Seconds waited."""
    start = time.monotonic()
    store.set(f"{KEY}/arrived/{rank}", f"{socket.gethostname()}:{os.getpid()}")
    arrived, verdict = {r: f"{KEY}/arrived/{r}" for r in range(world)}, f"{KEY}/verdict"
    if rank == 0:
        missing = missing_keys(store, arrived, timeout)
        if missing:
            message = _missing_message(store, missing, world, timeout, hint)
            store.set(verdict, "abort " + message)  # the ranks that came stop too, instead of waiting for it
            raise RankDidNotAnswer(message)
        store.set(verdict, "go")
        return time.monotonic() - start
    if missing_keys(store, {0: arrived[0]}, timeout):
        raise RankDidNotAnswer(f"rank 0 of {world} did not arrive within {timeout:g} s (rank {rank} waited)")
    if missing_keys(store, {0: verdict}, timeout + 5):  # rank 0 decides at most timeout s after it arrived
        raise RankDidNotAnswer(f"rank 0 gave no verdict on the arrivals within {timeout + 5:g} s (rank {rank} waited)")
    said = store.get(verdict).decode()
    if said != "go":
        raise RankDidNotAnswer(said.removeprefix("abort "))
    return time.monotonic() - start


# --------------------------------------------------------------------------- bandwidth


def bus_factor(op: str, n: int) -> float:
    """nccl-tests' bus bandwidth factor: all_reduce 2(n-1)/n (reduce-scatter then all-gather), the others (n-1)/n."""
    return (2 if op == "all_reduce" else 1) * (n - 1) / n


def sizes(max_bytes: int) -> list[int]:
    """4 KiB, 16 KiB, ... (x4) up to ``max_bytes``; ``[max_bytes]`` when that is under 4 KiB."""
    out, size = [], FIRST_SIZE
    while size <= max_bytes:
        out.append(size)
        size *= 4
    return out or [max_bytes]


def seconds_text(s: float) -> str:
    return f"{s * 1e6:.1f} us" if s < 1e-3 else f"{s * 1e3:.2f} ms" if s < 1 else f"{s:.2f} s"


@dataclass
class Timing:
    group: str  # "world" or a mesh dimension
    ranks: list[int]
    op: str
    size: int  # bytes each rank ends with
    seconds: float  # mean per call, the group's slowest rank
    wrong: bool  # some rank's result did not hold the expected values

    @property
    def algbw(self) -> float:
        return self.size / self.seconds

    @property
    def busbw(self) -> float:
        return self.algbw * bus_factor(self.op, len(self.ranks))


def _buffers(op: str, numel: int, n: int, me: int, device) -> tuple:
    """(call, output, expected output) for ``op`` with ``numel`` float32 elements out on each rank; the inputs hold
    values that make a wrong routing visible (a rank's own number, or sender x n + receiver)."""
    chunk = numel // n
    if op == "all_reduce":
        x = torch.full((numel,), float(me + 1), device=device)
        return lambda g: dist.all_reduce(x, group=g), x, torch.full_like(x, n * (n + 1) / 2)
    out = torch.empty(numel, device=device)
    senders = torch.arange(n, device=device, dtype=torch.float32)
    if op == "all_gather":
        x = torch.full((chunk,), float(me + 1), device=device)
        return lambda g: dist.all_gather_single(out, x, group=g), out, (senders + 1).repeat_interleave(chunk)
    x = (me * n + senders).repeat_interleave(chunk)  # chunk j goes to rank j
    return lambda g: dist.all_to_all_single(out, x, group=g), out, (senders * n + me).repeat_interleave(chunk)


def time_op(acc, op: str, group, size: int) -> tuple[float, bool]:
    """(mean seconds per call, wrong values) of ``op`` on ``group`` at ``size`` bytes, on this rank."""
    n, me = dist.get_world_size(group), dist.get_rank(group)
    numel = max(size // 4 // n, 1) * n  # float32 elements, a whole number of chunks per rank
    call, out, expected = _buffers(op, numel, n, me, acc.device)
    call(group)
    wrong = not torch.equal(out, expected)
    for _ in range(WARMUP - 1):
        call(group)
    acc.synchronize()
    start = time.perf_counter()
    for _ in range(ITERS):
        call(group)
    acc.synchronize()
    return (time.perf_counter() - start) / ITERS, wrong


def measure_group(acc, name: str, group, ranks: list[int], max_bytes: int) -> list[Timing]:
    """Every op at every size on ``group``; each figure is the group's slowest rank's (one more all_reduce)."""
    rows = []
    for op in OPS:
        for size in sizes(max_bytes):
            seconds, wrong = time_op(acc, op, group, size)
            worst = torch.tensor([seconds, float(wrong)], device=acc.device)  # float32: what every backend reduces
            dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=group)
            n = dist.get_world_size(group)
            size_out = max(size // 4 // n, 1) * n * 4
            rows.append(Timing(name, ranks, op, size_out, float(worst[0]), bool(worst[1])))
    return rows


def timing_table(rows: list[Timing]) -> list[list[str]]:
    return [
        [
            r.group,
            ranks_text(r.ranks),
            r.op,
            bytes_text(r.size),
            seconds_text(r.seconds),
            f"{r.algbw / 1e9:.3f} GB/s",
            f"{r.busbw / 1e9:.3f} GB/s",
            "WRONG VALUES" if r.wrong else "ok",
        ]
        for r in rows
    ]


TIMING_HEADER = ["group", "ranks", "op", "size", "time", "algbw", "busbw", "values"]


def communication(acc, store, rank: int, world: int, mesh, timeout: float, max_bytes: int) -> list[Timing]:
    """Every group's round and timings: the whole world, then each mesh dimension's group that holds this rank.
    Returns every group's rows on every rank (each group's lowest rank contributes them)."""
    groups = [("world", dist.group.WORLD)]
    groups += [(name, mesh[name].get_group()) for name in (mesh.mesh_dim_names if mesh is not None else ())]
    mine = []
    for name, group in groups:
        ranks = dist.get_process_group_ranks(group)
        reach_round(store, name, rank, ranks, timeout)
        try:
            rows = measure_group(acc, name, group, ranks, max_bytes)
        except RuntimeError as e:  # gloo/nccl/hccl's own timeout, or a peer that went away mid-round
            raise RankDidNotAnswer(f"the {name} round (ranks {ranks_text(ranks)}) failed: {e}") from None
        if rank == min(ranks):
            mine += rows
    reach_round(store, "report", rank, list(range(world)), timeout)
    gathered: list = [None] * world
    dist.all_gather_object(gathered, mine)
    return [row for rows in gathered for row in rows]
