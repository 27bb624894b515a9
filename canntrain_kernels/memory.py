"""Peak tensor memory of a function call, on any device.

On an NPU or GPU this is the allocator's own peak (``max_memory_allocated``). The CPU allocator
keeps no such statistic, so there :class:`TensorMemoryTracker` counts it directly: a dispatch
mode sees every tensor that an op (forward or backward) creates, adds its storage's bytes while
the storage is alive and subtracts them when it is freed. The result is the peak of
*newly allocated* tensor bytes during the call, above what existed before it.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class TensorMemoryTracker(TorchDispatchMode):
    """Live and peak bytes of the tensor storages created while the mode is active."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._seen: set[int] = set()
        self._external: dict[int, weakref.ref] = {}  # storages that existed before (views of them are free)

    def _is_external(self, storage) -> bool:
        ref = self._external.get(id(storage))
        return ref is not None and ref() is storage

    def _note_inputs(self, args, kwargs) -> None:
        for t in tree_flatten((args, kwargs))[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                if id(storage) not in self._seen and not self._is_external(storage):
                    self._external[id(storage)] = weakref.ref(storage)

    def _track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = id(storage)
        if key in self._seen or self._is_external(storage) or storage.nbytes() == 0:
            return
        self._seen.add(key)
        nbytes = storage.nbytes()
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, key, nbytes)

    def _free(self, key: int, nbytes: int) -> None:
        self._seen.discard(key)
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self._note_inputs(args, kwargs)
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self._track(t)
        return out


def peak_bytes(fn: Callable[[], Any], device: str = "cpu") -> int:
    """Peak bytes of tensor memory allocated while ``fn()`` runs (its result is dropped)."""
    mod = getattr(torch, device, None) if device != "cpu" else None
    if mod is not None and hasattr(mod, "max_memory_allocated"):
        mod.synchronize()
        base = mod.memory_allocated()
        mod.reset_peak_memory_stats()
        fn()
        mod.synchronize()
        return int(mod.max_memory_allocated() - base)
    tracker = TensorMemoryTracker()
    with tracker:
        result = fn()
    del result
    return tracker.peak
