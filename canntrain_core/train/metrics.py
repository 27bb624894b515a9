"""Throughput, FLOPs and MFU, and the metrics.jsonl log of a run."""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

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

    ``sinks`` are called with each record once it is in the file (the trackers of ``logging.trackers``,
    ``train/trackers.py``; a notebook's ``viz.live.LiveCurves``); a sink with a ``truncate_after(step)`` method is told
    when a resumed run drops the rows past its checkpoint (-1: a fresh start), one with ``close()`` when the log is
    closed."""

    def __init__(self, path: str | Path, sinks: list | None = None):
        self.path = Path(path)
        self.sinks: list[Callable[[dict[str, Any]], None]] = list(sinks or [])

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
