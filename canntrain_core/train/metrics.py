"""Throughput, FLOPs and MFU, and the metrics.jsonl log of a run."""

from __future__ import annotations

import functools
import json
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from canntrain_core.errors import RecipeError
from canntrain_core.runtime import Accelerator
from canntrain_core.runtime.accelerator import DTYPES
from canntrain_core.sizing.devices import spec_of_device
from canntrain_core.sizing.shapes import shape_of


def flops_per_token(config, seq_length: int) -> float:
    """Training FLOPs per token of a transformers config: ``ModelShape.flops_per_token`` (the one definition)."""
    return shape_of(config).flops_per_token(seq_length)


@functools.lru_cache(maxsize=8)
def measured_peak_flops(device: str, dtype: torch.dtype, n: int | None = None, repeats: int = 5) -> float:
    """FLOP/s of an n x n matmul on this device: the CPU's 'peak' for MFU (no vendor figure exists).
    ``n`` defaults to 2048 on an accelerator; on a CPU, whose caches a much smaller matmul already overflows, to
    1024 (measured on this project's 2-core machine, one thread: 98.8 GFLOP/s against 96.1 at 2048, in 0.15 s
    against 1.2 s, paid by every new training process) or to 512 for 16 bits (one without bf16 units runs a 2048
    bf16 matmul at under 1 GFLOP/s: 34 s each)."""
    cpu = torch.device(device).type == "cpu"
    n = n or ((1024 if dtype == torch.float32 else 512) if cpu else 2048)
    g = torch.Generator(device=device).manual_seed(0)  # its own RNG: measuring must not shift training's
    a = torch.randn(n, n, device=device, generator=g).to(dtype)
    b = torch.randn(n, n, device=device, generator=g).to(dtype)
    a @ b  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        if device != "cpu":
            getattr(torch, torch.device(device).type).synchronize()
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def peak_flops(acc: Accelerator, precision: str) -> tuple[float, str]:
    """Peak FLOP/s used for MFU and where the figure comes from: a 16-bit run on a device of the device table
    (``sizing.devices``) uses its dense 16-bit figure; anything else the measured matmul probe."""
    if acc.type != "cpu" and precision in ("bf16", "fp16"):
        spec = spec_of_device(acc.name())
        if spec is not None:
            return spec.peak_flops, f"{spec.name} spec"
    dtype = DTYPES.get(precision, torch.float32)
    return measured_peak_flops(str(acc.device), dtype), f"measured {precision} matmul probe"


class MetricsLog:
    """Append-only metrics.jsonl: one JSON object per line, flushed as written, and the source of truth.

    ``sinks`` are called with each record once it is in the file (TensorBoard with ``tensorboard=True``, a
    notebook's ``viz.live.LiveCurves``); a sink with a ``truncate_after(step)`` method is told when a resumed run
    drops the rows past its checkpoint, one with ``close()`` when the log is closed."""

    def __init__(self, path: str | Path, tensorboard: bool = False):
        self.path = Path(path)
        self.sinks: list[Callable[[dict[str, Any]], None]] = []
        if tensorboard:  # logging.tensorboard: its events beside metrics.jsonl
            self.sinks.append(TensorBoardSink(self.path.parent / "tensorboard"))

    def write(self, record: dict[str, Any]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        for sink in self.sinks:
            sink(record)

    def close(self) -> None:
        for sink in self.sinks:
            if hasattr(sink, "close"):
                sink.close()

    def truncate_after(self, step: int) -> None:
        """Drop lines past ``step`` (a resumed run rewrites what followed its checkpoint)."""
        for sink in self.sinks:
            if hasattr(sink, "truncate_after"):
                sink.truncate_after(step)
        if not self.path.is_file():
            return
        text = self.path.read_text()
        kept = "".join(json.dumps(r) + "\n" for r in _parse_lines(text) if r["step"] <= step)
        if kept == text:  # nothing to drop (not even a torn last line): the file stays as it is
            return
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text(kept)
        tmp.replace(self.path)


class TensorBoardSink:
    """A MetricsLog sink: each record's numbers (not its lists or strings) as TensorBoard scalars in ``log_dir``,
    tagged with the metric's name at global step ``record["step"]``, flushed as written.

    The writer opens at the first record, so only the rank that writes metrics creates the directory. After
    ``truncate_after(step)`` (a resume, or -1 for a fresh start in the same run directory) the next writer opens
    with ``purge_step=step + 1``: TensorBoard's readers then drop the earlier events from that step on, and a
    resumed run shows each step once, as metrics.jsonl does. The writer closes when the sink is garbage-collected
    or the interpreter exits (nothing is lost before then: every record is flushed)."""

    def __init__(self, log_dir: str | Path):
        self.log_dir = Path(log_dir)
        self._summary_writer = summary_writer_class()  # a missing package is reported now, before any step
        self.writer = None
        self.purge_step: int | None = None

    def __call__(self, record: dict[str, Any]) -> None:
        if self.writer is None:
            self.writer = self._summary_writer(str(self.log_dir), purge_step=self.purge_step)
            self._close = weakref.finalize(self, self.writer.close)  # at the latest when the interpreter exits
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(key, value, global_step=record["step"])
        self.writer.flush()

    def truncate_after(self, step: int) -> None:
        self.close()  # an open writer's events past ``step`` are purged by the next one
        self.purge_step = step + 1

    def close(self) -> None:
        if self.writer is not None:
            self._close()  # closes the writer now, once
            self.writer = None


def summary_writer_class():
    """torch's SummaryWriter, or a RecipeError naming ``logging.tensorboard`` when tensorboard is not installed.
    Imported here, not at the top: tensorboard is an optional dependency (pip install tensorboard, or the dev
    extra) that only ``logging.tensorboard: true`` needs, and importing it costs about a second."""
    try:
        # deferred: optional (tensorboard)
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:
        raise RecipeError(
            f"logging.tensorboard: true needs the tensorboard package ({e}); install it with "
            "`pip install tensorboard` (or `pip install -e .[dev]`), or set logging.tensorboard: false"
        ) from None
    return SummaryWriter


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    return _parse_lines(path.read_text())


def _parse_lines(text: str) -> list[dict[str, Any]]:
    """JSON lines; a torn last line (the process was killed while writing it) is dropped."""
    lines = [line for line in text.splitlines() if line.strip()]
    rows = []
    for i, line in enumerate(lines):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if i != len(lines) - 1:
                raise
    return rows
