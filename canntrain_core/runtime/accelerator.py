"""The accelerator layer: the one place that knows whether we run on an NPU, a GPU or the CPU.

Everything device-specific (collective backend, autocast dtype, synchronize, memory stats,
RNG seeding) goes through :class:`Accelerator`; the rest of canntrain never says ``if npu``.
Which device that is (npu > cuda > cpu, $CANNTRAIN_DEVICE) is decided once, in
``canntrain_kernels/device.py``, which the kernel registry reads too. Importing this module never
imports torch_npu; it is probed on first use and a failure to import it (no CANN toolkit) simply
means "no NPU".
"""

from __future__ import annotations

import ctypes
import importlib
import os
import random
import resource
import sys
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from canntrain_kernels.device import device_type

HALF_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}  # model.precision's 16-bit dtypes
DTYPES = {**HALF_DTYPES, "fp32": torch.float32}  # model.precision (and export/generate --dtype) as torch dtypes


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
        dtype = DTYPES[precision]
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

    def memory_in_use(self) -> int:
        """Bytes this process holds of what :meth:`limit_memory` limits: the device's allocator's reserve; on CPU the
        data size (heap and private mappings, /proc/self/status VmData), which RLIMIT_DATA bounds."""
        if self.module is not None:
            return int(self.module.memory_reserved(self.index))
        with open("/proc/self/status") as f:
            data = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmData:"))
        return data - _free_heap_bytes()  # freed blocks still in the heap are free to reuse

    def limit_memory(self, nbytes: int, since: int = 0) -> Callable[[], None]:
        """Let this process hold at most ``nbytes`` more than ``since`` (a :meth:`memory_in_use` reading) from now
        on, as a smaller device would: the caching allocator's per-process fraction on a GPU or NPU (allocations
        past it raise its out-of-memory error), the data size limit (RLIMIT_DATA) on a CPU. Returns the undo."""
        if self.module is not None:
            fraction = min(1.0, (since + nbytes) / self.memory_capacity_bytes())
            self.module.set_per_process_memory_fraction(fraction, self.index)
            return lambda: self.module.set_per_process_memory_fraction(1.0, self.index)
        _mmap_large_blocks()
        soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
        limit = since + nbytes if hard == resource.RLIM_INFINITY else min(hard, since + nbytes)
        resource.setrlimit(resource.RLIMIT_DATA, (limit, hard))
        return lambda: resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))

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


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _free_heap_bytes() -> int:
    """Bytes glibc's heap holds free (mallinfo2's fordblks); 0 where that cannot be read."""
    try:
        mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return 0
    mallinfo2.restype = _MallInfo2
    return int(mallinfo2().fordblks)


def _mmap_large_blocks() -> None:
    """glibc: blocks of 128 KiB and up in their own mappings, returned when freed (its threshold otherwise grows with
    the blocks freed, and freed tensors then stay in the heap): the data size then follows the live tensors, as a
    device allocator's limit does."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass  # not glibc: the limit still holds, a little less tightly


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
