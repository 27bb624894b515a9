"""The training loop's progress: tqdm's bar where someone watches it (a terminal, a notebook's widget), else one line
per log interval, for a batch job's log (torchrun, Slurm: a redrawn bar there becomes a line per step, prefixed by
each rank)."""

from __future__ import annotations

import sys
import time
from typing import IO

from tqdm.auto import tqdm


def watched(stream: IO) -> bool:
    """Whether ``stream`` is a terminal or a notebook kernel's (whose bar is a live widget)."""
    if stream.isatty():
        return True
    ipython = sys.modules.get("IPython")  # imported by any kernel; never imported here for the question
    shell = ipython.get_ipython() if ipython is not None else None
    return type(shell).__name__ == "ZMQInteractiveShell"


class LogLines:
    """tqdm's interface for a log: ``set_postfix`` (called at each log interval) prints one line with the step, the
    figures and the time left at the interval's pace."""

    def __init__(self, total: int, initial: int, desc: str, stream: IO):
        self.total, self.n, self.desc, self.stream = total, initial, desc, stream
        self.start, self.first = time.perf_counter(), initial

    def update(self, n: int = 1) -> None:
        self.n += n

    def set_postfix(self, figures: dict | None) -> None:
        if figures is None:
            return
        elapsed = time.perf_counter() - self.start
        left = elapsed / max(1, self.n - self.first) * (self.total - self.n)
        shown = " ".join(f"{k} {v}" for k, v in figures.items())
        print(
            f"{self.desc}: step {self.n}/{self.total} ({100 * self.n / self.total:.0f}%) {shown} "
            f"elapsed {_clock(elapsed)} left {_clock(left)}",
            file=self.stream,
            flush=True,
        )

    def close(self) -> None:
        pass


def _clock(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def progress_bar(total: int, initial: int, desc: str, enabled: bool, stream: IO | None = None):
    """The loop's progress display (``enabled``: rank 0 and not --no-progress)."""
    stream = stream or sys.stderr
    if enabled and not watched(stream):
        return LogLines(total, initial, desc, stream)
    return tqdm(total=total, initial=initial, desc=desc, disable=not enabled, file=stream)
