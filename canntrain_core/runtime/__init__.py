"""Runtime: accelerator selection, process groups and device meshes, rank tables."""

from canntrain_core.runtime.accelerator import Accelerator, get_accelerator, seed_everything
from canntrain_kernels.device import npu_available

__all__ = ["Accelerator", "get_accelerator", "npu_available", "seed_everything"]
