"""Models: every family's transformers classes (``canntrain_core/families/``: Llama 2/3, Qwen2/2.5, Qwen3, Mistral,
GPT-2, Mixtral, Qwen2-MoE, Qwen3-MoE) built from a preset (tiny to 70B and the MoE shapes) or from a Hugging Face
directory (``model.init_from``), with canntrain's training wrapper, LoRA, decoding and Hugging Face reading."""

from canntrain_core.models.registry import build_config, build_model, count_parameters
from canntrain_core.sizing.presets import PRESETS

__all__ = ["PRESETS", "build_config", "build_model", "count_parameters"]
