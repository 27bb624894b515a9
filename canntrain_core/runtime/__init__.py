"""Runtime: accelerator selection, process groups and device meshes, rank tables."""

from canntrain_core.runtime.accelerator import Accelerator, get_accelerator, npu_available, seed_everything

__all__ = ["Accelerator", "get_accelerator", "npu_available", "seed_everything"]
