"""Where a step's time goes (``logging.profile.enabled``): wall time per phase, the device synchronised at the end
of each phase so that its queued work is counted in the phase that queued it. Off, nothing is timed and nothing is
synchronised: the loop runs as fast as without it.

Phases: ``data`` (waiting for the next batch), ``forward``, ``backward`` (with the gradient reduction FSDP2 and
DDP overlap with it), ``forward_backward`` (a pipeline schedule, which interleaves them), ``optimizer``
(clipping and the step). PPO and GRPO log their generation, scoring and update apart (verl's ``timing_s/*``).
The rules of the cann-recipes-train
articles' troubleshooting chapter read the result (:func:`advice`).
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

PHASES = ("data", "forward", "backward", "forward_backward", "optimizer")


class StepTimer:
    def __init__(self, enabled: bool, synchronize: Callable[[], None]):
        self.enabled, self.synchronize = enabled, synchronize
        self.seconds: dict[str, float] = defaultdict(float)

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        start = time.perf_counter()
        try:
            yield
        finally:
            self.synchronize()
            self.seconds[phase] += time.perf_counter() - start

    def take(self, steps: int) -> dict[str, float]:
        """``time/<phase>``: seconds per step of each phase since the last call (and reset)."""
        out = {f"time/{p}": self.seconds[p] / steps for p in PHASES if p in self.seconds}
        self.seconds.clear()
        return out


def advice(record: dict) -> list[str]:
    """What a logged breakdown says to change (the articles' rules: data over 10 % of the step means the loader
    starves the device)."""
    step = record.get("step_time")
    data = record.get("time/data")
    out = []
    if step and data is not None and data > 0.1 * step:
        out.append(
            f"data loading takes {data / step:.0%} of the step ({data * 1e3:.1f} of {step * 1e3:.1f} ms): raise "
            "data.num_workers and set data.persistent_workers: true"
        )
    return out


class TraceWindow:
    """``logging.profile.trace``: the accelerator's profiler running from the first to the last of ``steps``,
    its trace written to ``out_dir`` (one file per rank) when the window closes."""

    def __init__(self, profile, out_dir: Path, acc, rank: int):
        self.first, self.last = profile.steps
        self.enabled, self.out_dir, self.acc, self.rank = profile.trace, out_dir, acc, rank
        self.profiler = None

    def before(self, step: int) -> None:
        if self.enabled and step == self.first and self.profiler is None:
            self.profiler = self.acc.profiler(str(self.out_dir), f"rank{self.rank}")
            self.profiler.start()

    def after(self, step: int) -> None:
        if self.profiler is not None and step >= self.last:
            self.close()

    def close(self) -> None:
        """Stop and write the trace (also when the loop ends inside the window)."""
        if self.profiler is not None:
            self.profiler.stop()
            self.profiler = None
