"""The accelerator layer: the one place that knows whether we run on an NPU, a GPU or the CPU.

Everything device-specific (collective backend, autocast dtype, synchronize, memory stats,
RNG seeding) goes through :class:`Accelerator`; the rest of canntrain never says ``if npu``.
Which device that is (npu > cuda > cpu, $CANNTRAIN_DEVICE) is decided once, in
``canntrain_kernels/device.py``, which the kernel registry reads too. Importing this module never
imports torch_npu; it is probed on first use and a failure to import it (no CANN toolkit) simply
means "no NPU".
"""

from __future__ import annotations

import importlib
import os
import random
import resource
import sys
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from canntrain_kernels.device import device_type

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class Accelerator:
    """Device facts and device-specific calls for one process."""

    type: str  # "npu" | "cuda" | "cpu"
    index: int = 0

    @property
    def device(self) -> torch.device:
        return torch.device(self.type, self.index) if self.type != "cpu" else torch.device("cpu")

    @property
    def backend(self) -> str:
        """The torch.distributed backend for this device: hccl, nccl or gloo."""
        return {"npu": "hccl", "cuda": "nccl"}.get(self.type, "gloo")

    @property
    def module(self) -> Any:
        """torch.npu / torch.cuda, or None on CPU."""
        return getattr(torch, self.type) if self.type != "cpu" else None

    def device_count(self) -> int:
        return self.module.device_count() if self.module is not None else 1

    def supports_dtype(self, precision: str) -> bool:
        if precision == "bf16" and self.type == "cuda":
            return torch.cuda.is_bf16_supported()
        return True

    def autocast(self, precision: str):
        """Mixed-precision context for forward passes; fp32 is a no-op."""
        dtype = _DTYPES[precision]
        if dtype == torch.float32:
            return nullcontext()
        if not self.supports_dtype(precision):
            raise RuntimeError(f"model.precision={precision} is not supported on {self.type}")
        return torch.autocast(device_type=self.type, dtype=dtype)

    def profiler(self, out_dir: str, worker: str):
        """A profiler of this process's CPU and device activity that writes a trace to ``out_dir`` when stopped
        (TensorBoard's profiler plugin and Perfetto read it); torch_npu's profiler on an NPU (its traces are CANN's,
        read by the same tools), torch's elsewhere."""
        prof = importlib.import_module("torch_npu").profiler if self.type == "npu" else torch.profiler
        device = {"npu": "NPU", "cuda": "CUDA"}.get(self.type)
        activities = [prof.ProfilerActivity.CPU] + ([getattr(prof.ProfilerActivity, device)] if device else [])
        return prof.profile(
            activities=activities,
            profile_memory=True,
            record_shapes=True,
            on_trace_ready=prof.tensorboard_trace_handler(out_dir, worker_name=worker),
        )

    def synchronize(self) -> None:
        if self.module is not None:
            self.module.synchronize()

    def reset_peak_memory(self) -> None:
        if self.module is not None:
            self.module.reset_peak_memory_stats()

    def peak_memory_bytes(self) -> int:
        """Peak allocated device memory; on CPU the process's peak resident set size."""
        if self.module is not None:
            return int(self.module.max_memory_allocated())
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(rss if sys.platform == "darwin" else rss * 1024)  # Linux reports KiB

    def memory_capacity_bytes(self) -> int | None:
        if self.module is not None:
            return int(self.module.get_device_properties(self.index).total_memory)
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError):
            return None

    def name(self) -> str:
        if self.module is not None:
            return str(self.module.get_device_name(self.index))
        return "cpu"

    def set_device(self) -> None:
        if self.module is not None:
            self.module.set_device(self.index)

    def rng_state(self) -> dict[str, Any]:
        """Every RNG state a bit-exact resume needs."""
        state = {
            "python": random.getstate(),
            "numpy": np.random.get_state(),
            "torch": torch.get_rng_state(),
        }
        if self.module is not None:
            state[self.type] = self.module.get_rng_state(self.index)
        return state

    def set_rng_state(self, state: dict[str, Any]) -> None:
        random.setstate(state["python"])
        np.random.set_state(state["numpy"])
        torch.set_rng_state(state["torch"])
        if self.module is not None and self.type in state:
            self.module.set_rng_state(state[self.type], self.index)


def seed_everything(seed: int) -> None:
    """Seed python, numpy, torch and every visible device RNG."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds CUDA; torch_npu patches it to seed NPUs too


def get_accelerator(prefer: str | None = None) -> Accelerator:
    """npu (torch_npu importable and a device present) > cuda > cpu.

    ``prefer`` (or $CANNTRAIN_DEVICE) forces one, e.g. "cpu" on a GPU host for a test.
    The device index is LOCAL_RANK under torchrun.
    """
    kind = device_type(prefer)
    return Accelerator(kind, int(os.environ.get("LOCAL_RANK", "0")) if kind != "cpu" else 0)
