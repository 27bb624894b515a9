"""What the loop does around a step that is not the step: callbacks, as OLMo-core's trainer takes them.

``Trainer.fit`` calls each of ``Trainer.callbacks`` at five points: ``on_fit_start`` once, ``before_step`` before a
step's batch is fetched, ``after_iteration`` right after the stage's ``train_iteration`` (before the schedule steps),
``after_step`` once the step's row is made (and evaluated), ``on_fit_end`` once in reverse order, however the loop
ended. The engine's own are below (the memory budget, the throughput clock, the profiler's trace window, the
progress display); a user's
are passed as ``Trainer(..., callbacks=[...])`` and run after them. Metrics sinks (TensorBoard, a notebook's live
curves) hang on the metrics log instead: they see every row, whoever writes it.
"""

from __future__ import annotations

import contextlib
import time
from typing import Iterator

from canntrain_core.train.progress import progress_bar
from canntrain_core.train.timing import TraceWindow


class Callback:
    """A callback's five points; each does nothing unless overridden."""

    def on_fit_start(self, trainer) -> None:
        pass

    def before_step(self, trainer, step: int) -> None:
        pass

    def after_iteration(self, trainer, step: int) -> None:
        pass

    def after_step(self, trainer, raw: dict, record: dict) -> None:
        pass

    def on_fit_end(self, trainer) -> None:
        pass


class MemoryBudget(Callback):
    """``distributed.memory_budget_gb``: the allocator's limit while the loop runs, lifted when it ends."""

    def on_fit_start(self, trainer) -> None:
        trainer.limit_memory()

    def on_fit_end(self, trainer) -> None:
        trainer.release_memory()


class Throughput(Callback):
    """The logging interval being timed: its steps counted, evaluation and checkpoints paused off its clock;
    ``take`` (when a row is logged) reads it and starts the next. An evaluation alone does not end one."""

    def __init__(self) -> None:
        self._restart()

    def _restart(self) -> None:
        self.start, self.steps = time.perf_counter(), 0

    def on_fit_start(self, trainer) -> None:
        self._restart()

    def after_iteration(self, trainer, step: int) -> None:
        self.steps += 1

    def take(self) -> tuple[int, float]:
        """The interval's steps and seconds per step; the next interval starts now."""
        steps, per_step = self.steps, (time.perf_counter() - self.start) / max(self.steps, 1)
        self._restart()
        return steps, per_step

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.start += time.perf_counter() - started


class Trace(Callback):
    """``logging.profile.trace``: the profiler from the first to the last of ``logging.profile.steps``."""

    def on_fit_start(self, trainer) -> None:
        r = trainer.recipe
        self.window = TraceWindow(r.logging.profile, trainer.run_dir / "profile", trainer.acc, trainer.rank)

    def before_step(self, trainer, step: int) -> None:
        self.window.before(step)

    def after_iteration(self, trainer, step: int) -> None:
        self.window.after(step)

    def on_fit_end(self, trainer) -> None:
        self.window.close()


class Progress(Callback):
    """The progress bar (rank 0, unless --no-progress): a step counter and the stage's figures (``postfix``)."""

    def on_fit_start(self, trainer) -> None:
        r = trainer.recipe
        self.bar = progress_bar(r.optim.max_steps, trainer.step, r.experiment.name, trainer.progress)

    def after_step(self, trainer, raw: dict, record: dict) -> None:
        self.bar.update(1)
        if trainer.progress:
            self.bar.set_postfix(trainer.postfix(raw, record))

    def on_fit_end(self, trainer) -> None:
        self.bar.close()


def engine_callbacks(trainer) -> list[Callback]:
    """The engine's own, in the order they start (the trainer's ``throughput`` is read by its ``log_record``)."""
    return [MemoryBudget(), trainer.throughput, Trace(), Progress()]
