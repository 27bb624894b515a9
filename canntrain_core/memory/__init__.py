"""Memory: the analytic per-rank estimator, fake-mode measurement, the plan search, the OOM hint."""

from canntrain_core.memory.devices import DEVICES, DeviceSpec, get_device, parse_bytes
from canntrain_core.memory.estimator import CATEGORIES, GB, GiB, MemoryEstimate, estimate
from canntrain_core.memory.oom import oom_hint
from canntrain_core.memory.setup import LoraSetup, TrainSetup, setup_from_recipe, shape_from_recipe
from canntrain_core.memory.shapes import EXTRA_SHAPES, ModelShape, shape_from_preset

__all__ = [
    "CATEGORIES", "DEVICES", "EXTRA_SHAPES", "GB", "GiB", "DeviceSpec", "LoraSetup", "MemoryEstimate", "ModelShape",
    "TrainSetup", "estimate", "get_device", "oom_hint", "parse_bytes", "setup_from_recipe", "shape_from_preset",
    "shape_from_recipe",
]
