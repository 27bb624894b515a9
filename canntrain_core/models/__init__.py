"""Model registry: presets (tiny, llama2-7b/13b/70b) on transformers' Llama classes."""

from canntrain_core.models.registry import build_config, build_model, count_parameters
from canntrain_core.sizing.presets import PRESETS

__all__ = ["PRESETS", "build_config", "build_model", "count_parameters"]
