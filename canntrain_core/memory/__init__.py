"""Memory tools: `canntrain estimate` / `canntrain plan`, fake-mode and real measurement, reports and charts.

The arithmetic they show (the analytic per-rank estimator, the plan search, the OOM hint, model shapes and
device presets) lives in ``canntrain_core.sizing``; its main names are re-exported here.
"""

from canntrain_core.memory.recipe_shape import shape_from_recipe
from canntrain_core.sizing.devices import DEVICES, DeviceSpec, get_device, parse_bytes
from canntrain_core.sizing.estimator import CATEGORIES, GB, GiB, MemoryEstimate, estimate
from canntrain_core.sizing.oom import oom_hint
from canntrain_core.sizing.setup import LoraSetup, TrainSetup, setup_from_recipe
from canntrain_core.sizing.shapes import EXTRA_SHAPES, ModelShape, shape_from_preset

__all__ = [
    "CATEGORIES",
    "DEVICES",
    "EXTRA_SHAPES",
    "GB",
    "GiB",
    "DeviceSpec",
    "LoraSetup",
    "MemoryEstimate",
    "ModelShape",
    "TrainSetup",
    "estimate",
    "get_device",
    "oom_hint",
    "parse_bytes",
    "setup_from_recipe",
    "shape_from_preset",
    "shape_from_recipe",
]
