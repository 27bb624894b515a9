"""Runtime: accelerator selection and (in later issues) process groups and device meshes."""

from canntrain_core.runtime.accelerator import Accelerator, get_accelerator, npu_available, seed_everything

__all__ = ["Accelerator", "get_accelerator", "npu_available", "seed_everything"]
