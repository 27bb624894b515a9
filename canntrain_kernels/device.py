"""Which device this process computes on: npu > cuda > cpu, or the one ``$CANNTRAIN_DEVICE`` names.

The one definition: the kernel registry picks backends for it, and ``canntrain_core.runtime.accelerator``
builds its Accelerator from it. Importing this module never imports torch_npu; it is probed on first use
and a failure to import it (no CANN toolkit) simply means "no NPU".
"""

from __future__ import annotations

import functools
import importlib
import os

import torch

DEVICE_ENV = "CANNTRAIN_DEVICE"


@functools.lru_cache(maxsize=1)
def npu_available() -> bool:
    """True when torch_npu imports and at least one NPU is visible."""
    try:
        importlib.import_module("torch_npu")
    except Exception:  # ImportError, or CANN libraries missing at load time
        return False
    return hasattr(torch, "npu") and torch.npu.is_available() and torch.npu.device_count() > 0


def device_type(prefer: str | None = None) -> str:
    """ "npu" (torch_npu importable and a device present) > "cuda" > "cpu".

    ``prefer`` (or $CANNTRAIN_DEVICE) forces one, e.g. "cpu" on a GPU host for a test; forcing a device that
    is not here raises RuntimeError.
    """
    prefer = prefer or os.environ.get(DEVICE_ENV)
    if prefer:
        if prefer == "npu" and not npu_available():
            raise RuntimeError(f"{DEVICE_ENV}=npu but torch_npu or an NPU is not available")
        if prefer == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(f"{DEVICE_ENV}=cuda but CUDA is not available")
        return prefer
    if npu_available():
        return "npu"
    if torch.cuda.is_available():
        return "cuda"
    return "cpu"
