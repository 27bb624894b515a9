"""What every stage's loop watches beside its metrics, and logs of it: where a step's time goes (``StepTimer``,
``logging.profile``), NaN or inf gradient norms (``optim.nonfinite``), gradient norm spikes
(``logging.grad_spike_factor``) and how long the last checkpoint took."""

from __future__ import annotations

import math
import statistics
from collections import deque
from pathlib import Path
from typing import Any, Callable

from canntrain_core.errors import NonFinite
from canntrain_core.runtime.log import get_logger
from canntrain_core.train.timing import StepTimer, advice


def checkpoint_sentence(last: Path | None) -> str:
    """What a run that stops says of the checkpoint to resume from."""
    return f"The last complete checkpoint is {last}." if last else "No checkpoint was written yet."


log = get_logger(__name__)


class Health:
    def __init__(self, recipe, rank: int, synchronize: Callable[[], None]):
        self.policy = recipe.optim.nonfinite
        self.spike_factor = recipe.logging.grad_spike_factor
        self.rank = rank
        self.timer = StepTimer(recipe.logging.profile.enabled, synchronize)
        self.skipped_steps = 0  # updates skipped for a NaN or inf gradient norm (kept in checkpoints)
        self.grad_norms: deque[float] = deque(maxlen=20)  # the last steps' gradient norms: a spike's yardstick
        self.spikes = 0  # gradient norm spikes since the last log
        self.last_spike: tuple[int, float] = (0, 0.0)  # (step, gradient norm) of the latest
        self.advised: set[str] = set()  # what the breakdown's advice has said already
        self.checkpoint_seconds: float | None = None  # the last save's, logged with the next row

    def allows(self, norm: float, step: int, last_checkpoint: Callable[[], Path | None]) -> bool:
        """Whether step ``step``'s update with gradient norm ``norm`` is applied: a finite norm is (and is watched
        for spikes); a NaN or inf one is skipped and counted (``optim.nonfinite: skip``) or stops the run naming
        ``last_checkpoint()`` (``stop``)."""
        if math.isfinite(norm):
            self._watch(norm, step)
            return True
        if self.policy == "skip":
            self.skipped_steps += 1
            self._say(f"step {step}: gradient norm {norm}: update skipped (optim.nonfinite: skip)")
            return False
        last = last_checkpoint()
        then = "resume from it (--resume-from auto)" if last else "start again"
        raise NonFinite(
            f"step {step}: the gradient norm is {norm} (a NaN or inf loss or gradient). {checkpoint_sentence(last)} "
            f"Lower optim.lr or tighten optim.grad_clip and {then}, or set optim.nonfinite=skip"
        )

    def _watch(self, norm: float, step: int) -> None:
        median = statistics.median(self.grad_norms) if len(self.grad_norms) >= 5 else None
        if self.spike_factor and median and norm > self.spike_factor * median:
            self.spikes += 1
            self.last_spike = (step, norm)
            self._say(
                f"step {step}: gradient norm {norm:.3g} is {norm / median:.0f}x the median of the last "
                f"{len(self.grad_norms)} steps (logging.grad_spike_factor {self.spike_factor:g})"
            )
        self.grad_norms.append(norm)

    def _say(self, line: str) -> None:
        if self.rank == 0:  # every rank sees the same norm: one says it
            log.warning(line)

    def take(self, steps: int, step_time: float) -> dict[str, Any]:
        """The row's share: seconds per step of each phase over the last ``steps`` (``logging.profile``), skipped
        steps (cumulative), spikes since the last row, the last checkpoint's seconds; the breakdown's advice is
        printed once."""
        out: dict[str, Any] = self.timer.take(steps)
        if self.skipped_steps:
            out["skipped_steps"] = self.skipped_steps
        if self.spikes:  # how many since the last row, and the last one's step and norm (a plot can mark it)
            out["grad_norm_spikes"], self.spikes = self.spikes, 0
            out["grad_norm_spike_step"], out["grad_norm_spike"] = self.last_spike
        if self.checkpoint_seconds is not None:
            out["checkpoint_seconds"], self.checkpoint_seconds = self.checkpoint_seconds, None
        for line in advice({"step_time": step_time, **out}):
            if line not in self.advised:
                self.advised.add(line)
                self._say(line)
        return out
