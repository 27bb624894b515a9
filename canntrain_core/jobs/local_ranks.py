"""Run a function on N local ranks (gloo on CPU, one device each elsewhere), forked from a process that has
already imported what they need.

torchrun execs a fresh interpreter per rank, and each spends about 5 s of CPU importing torch, transformers and
canntrain before its first step (a 4-rank launch: 20 CPU-s). A notebook or a test that compares layouts pays that
for seconds of training. Here the ranks come from Python's forkserver: a server process imports the ``preload``
modules once (it starts no thread and touches no device, so forking it is safe), and each rank is a fork of it that
inherits those modules. Every later launch from the same process reuses the server. Each rank gets the environment a
torchrun rank gets (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), the caller's
environment and working directory at the time of the call, and its output in a file. A rank that fails stops the
others, as torchrun stops them, and its output's tail is raised.

This is for one host. A job across hosts, or one that needs torchrun's restarts, is launched with torchrun
(``canntrain launch``).
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import time
from pathlib import Path
from typing import Callable

import torch

from canntrain_core.runtime.distributed import free_port

# What a training rank needs: importing it is most of a rank's start-up (torch, transformers, canntrain).
TRAINING_STACK = ("canntrain_core.stages",)
_GRACE_S = 10.0  # after a rank fails, how long the others have to stop on SIGTERM before SIGKILL


class RanksFailed(RuntimeError):
    """A rank exited non-zero or the job ran past its timeout; the message ends with that rank's output."""


def _rank_main(target: Callable, args: tuple, env: dict, cwd: str, log: str) -> None:
    """In the forked rank: its environment, working directory and log, then ``target(*args)``."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    if env.get("OMP_NUM_THREADS"):
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))  # torch was imported before this rank's environment
    target(*args)  # an exception: multiprocessing prints its traceback to stderr (the log) and exits 1


def run_local_ranks(
    target: Callable,
    args: tuple,
    nproc: int,
    log_dir: str | Path,
    *,
    preload: tuple[str, ...] = TRAINING_STACK,
    timeout: float = 900,
    env: dict[str, str] | None = None,
) -> list[str]:
    """Run ``target(*args)`` on ``nproc`` local ranks of one job; return each rank's output (stdout and stderr).

    ``target`` is a module-level function (the ranks receive it by name). ``preload``: the modules the server imports
    when this process first launches (later launches reuse that server). ``log_dir``/rank<R>.log keeps each rank's
    output. ``env`` is added to the caller's environment; OMP_NUM_THREADS defaults to 1, as under torchrun.
    Raises :class:`RanksFailed` naming the first rank that failed, with its output's tail.
    """
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(preload))  # read only when the server starts: the first launch of this process
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    base = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **(env or {})}
    base.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc)
    )
    logs = [log_dir / f"rank{rank}.log" for rank in range(nproc)]
    procs = []
    for rank in range(nproc):
        rank_env = {**base, "RANK": str(rank), "LOCAL_RANK": str(rank)}
        procs.append(ctx.Process(target=_rank_main, args=(target, args, rank_env, os.getcwd(), str(logs[rank]))))
        procs[-1].start()
    failed = _wait(procs, timeout)
    outputs = [log.read_text(errors="replace") if log.is_file() else "" for log in logs]
    if failed is not None:
        rank, why = failed
        said = outputs[rank][-4000:] or (
            "(nothing: it failed before starting; a script that launches ranks needs its code under "
            '`if __name__ == "__main__":`, as every multiprocessing start method but fork does)'
        )
        raise RanksFailed(f"rank {rank} of {nproc} {why} (its output: {logs[rank]}):\n{said}")
    return outputs


def _wait(procs: list, timeout: float) -> tuple[int, str] | None:
    """Wait for every rank; on the first failure or at the timeout stop the rest. (rank, what happened) or None."""
    deadline = time.monotonic() + timeout
    failed = None
    while failed is None and any(p.exitcode is None for p in procs):
        multiprocessing.connection.wait([p.sentinel for p in procs if p.exitcode is None], timeout=1.0)
        for rank, p in enumerate(procs):
            if p.exitcode not in (None, 0):
                failed = (rank, f"exited with code {p.exitcode}")
                break
        if failed is None and time.monotonic() > deadline:
            failed = (next(r for r, p in enumerate(procs) if p.exitcode is None), f"ran past {timeout:.0f} s")
    if failed is not None:
        for p in procs:
            if p.exitcode is None:
                p.terminate()
        end = time.monotonic() + _GRACE_S
        for p in procs:
            p.join(max(0.0, end - time.monotonic()))
            if p.exitcode is None:
                p.kill()
                p.join()
    else:
        for p in procs:
            p.join()
    return failed
