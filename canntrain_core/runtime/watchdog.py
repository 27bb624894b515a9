"""A collective that never finishes, named: which collective, over which ranks, and which ranks had not got there.

Each rank posts where it is (step and phase) to the job's store, a key per rank, twice a step. When a
collective fails on a rank (gloo raises after ``distributed.timeout_seconds``; a peer that died closes the
connection), that rank reads its flight recorder (torch's record of the collectives it issued, on from
:func:`enable_flight_recorder`) for the last one and the store for the others' positions, and says so in one
line. NCCL and HCCL have watchdogs that abort the process instead of raising: there the flight recorder's dump
(``TORCH_FR_DUMP_TEMP_FILE``, written on timeout when ``TORCH_NCCL_DUMP_ON_TIMEOUT=1``) is the record.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch._C._distributed_c10d as _c10d
import torch.distributed as dist

# a step's order: waiting for its batch; forward, backward and the update; its evaluation; its checkpoint
PHASES = ("data", "compute", "evaluate", "checkpoint")
_KEY = "canntrain/where/{}"


def enable_flight_recorder(entries: int = 2000) -> None:
    """Keep the last ``entries`` collectives of every process group (read on a failure); before the groups are
    made. A user's own setting wins."""
    if "TORCH_NCCL_TRACE_BUFFER_SIZE" not in os.environ:
        os.environ.setdefault("TORCH_FR_BUFFER_SIZE", str(entries))


def is_collective_failure(error: BaseException) -> bool:
    """A collective timed out, or a peer's connection closed or was reset under it (gloo's words; NCCL's
    DistBackendError); also when torch's CheckpointException carries it from a save's collectives."""
    text = str(error)
    return isinstance(error, dist.DistBackendError) or any(
        s in text
        for s in ("Timed out waiting", "Connection closed by peer", "Connection reset by peer", "Socket Timeout")
    )


@dataclass(frozen=True)
class Position:
    step: int
    phase: str

    def __lt__(self, other: "Position") -> bool:
        return (self.step, PHASES.index(self.phase)) < (other.step, PHASES.index(other.phase))

    def __str__(self) -> str:
        return f"step {self.step} ({self.phase})"


class Whereabouts:
    """This rank's position, posted to the default group's store (one small write per phase; none outside a
    process group), and the others' read back after a failure."""

    def __init__(self):
        on = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        self.store = dist.distributed_c10d._get_default_store() if on else None
        self.rank = dist.get_rank() if on else 0
        self.world = dist.get_world_size() if on else 1
        self.here = Position(0, "data")

    def post(self, step: int, phase: str) -> None:
        self.here = Position(step, phase)
        if self.store is not None:
            self.store.set(_KEY.format(self.rank), f"{step} {phase}")

    def behind(self) -> dict[int, Position | None]:
        """The ranks that had not reached this rank's position (None: never posted), by rank."""
        found = {}
        for r in range(self.world):
            key = _KEY.format(r)
            if r == self.rank:
                continue
            if not self.store.check([key]):
                found[r] = None
                continue
            step, phase = self.store.get(key).decode().split()
            if Position(int(step), phase) < self.here:
                found[r] = Position(int(step), phase)
        return found


def last_collective() -> str | None:
    """The last collective this rank issued, from the flight recorder: "gloo:all_gather of [[4]] over group
    mesh_dp_shard (ranks [0, 1])"; None when the recorder is off or has nothing."""
    try:
        dump = json.loads(_c10d._dump_fr_trace_json(True, True))  # (include collectives, include stack traces)
    except (AttributeError, RuntimeError, ValueError):
        return None
    entries = dump.get("entries") or []
    if not entries:
        return None
    e = max(entries, key=lambda x: x["record_id"])
    name, desc = e["process_group"]  # (group name, its description: "mesh_tp", "default_pg")
    try:
        ranks = dist.get_process_group_ranks(dist.distributed_c10d._resolve_process_group(name))
    except (AttributeError, RuntimeError, ValueError):
        ranks = "?"
    return f"{e['profiling_name']} of {e['input_sizes']} over group {desc or name} (ranks {ranks})"


def describe_failure(error: BaseException, where: Whereabouts, timeout_s: int) -> str:
    """One line: this rank, what it was waiting in, where it was, and who had not got there."""
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    what = last_collective() or "a collective"
    timed_out = "Timed out" in first or "Timeout" in first
    verb = f"did not finish within distributed.timeout_seconds={timeout_s}" if timed_out else "failed"
    line = f"rank {where.rank}: {what} {verb} in {where.here}, after step {where.here.step - 1} completed"
    if where.store is not None:
        behind = where.behind()
        if behind:
            names = ", ".join(f"rank {r} at {p or 'no step yet'}" for r, p in sorted(behind.items()))
            line += f". Not there yet: {names}"
        elif timed_out:
            line += ". Every rank had reached this step: suspect the network or a device (run canntrain doctor)"
    return f"{line}. ({first})"
