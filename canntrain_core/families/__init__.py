"""The model families canntrain builds, one module each (``llama``, ``qwen2``, ``qwen3``, ``mistral``, ``gpt2``,
``mixtral``, ``qwen2_moe``, ``qwen3_moe``): pure data that the recipe schema, the estimator, the model builder,
the TP plan and the kernels read.

Adding a family is one module here (a :class:`~canntrain_core.families.family.Family`) and one entry in
:data:`FAMILIES`; nothing else names a family.
"""

from __future__ import annotations

from typing import Any

from canntrain_core.errors import BadInput
from canntrain_core.families.family import Family
from canntrain_core.families.gpt2 import GPT2
from canntrain_core.families.llama import LLAMA
from canntrain_core.families.mistral import MISTRAL
from canntrain_core.families.mixtral import MIXTRAL
from canntrain_core.families.qwen2 import QWEN2
from canntrain_core.families.qwen2_moe import QWEN2_MOE
from canntrain_core.families.qwen3 import QWEN3
from canntrain_core.families.qwen3_moe import QWEN3_MOE

FAMILIES: dict[str, Family] = {f.name: f for f in (LLAMA, QWEN2, QWEN3, MISTRAL, GPT2, MIXTRAL, QWEN2_MOE, QWEN3_MOE)}
PRESET_FAMILY: dict[str, Family] = {p: f for f in FAMILIES.values() for p in f.presets}
_BY_MODEL_TYPE: dict[str, Family] = {t: f for f in FAMILIES.values() for t in f.model_types}


def family_of_preset(preset: str) -> Family:
    return PRESET_FAMILY[preset]


def family_of_model_type(model_type: Any, where: str = "config.json") -> Family:
    """The family that reads ``model_type`` (config.json's); a BadInput naming ``where`` and the types
    canntrain builds otherwise."""
    if model_type not in _BY_MODEL_TYPE:
        raise BadInput(
            f"{where}: model_type {model_type!r}; canntrain builds {', '.join(sorted(_BY_MODEL_TYPE))} models"
        )
    return _BY_MODEL_TYPE[model_type]


def family_of(config: Any) -> Family:
    """The family of a transformers config (its ``model_type``), or of a namespace of preset fields."""
    return family_of_model_type(getattr(config, "model_type", "llama"))
