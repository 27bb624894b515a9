"""The classes of a family (``canntrain_core/families/``): transformers', by the names the family gives
them, and canntrain's own trees."""

from __future__ import annotations

from typing import Any

import transformers

from canntrain_core.families import Family, family_of, family_of_model_type
from canntrain_core.models import gpt2

# canntrain's own module trees, by the names the families give them (Family.own_class)
_OWN = {"GPT2ForTraining": gpt2.GPT2ForTraining}


def config_class(family: Family) -> type:
    return getattr(transformers, family.config_class)


def causal_lm_class(config: Any) -> type:
    """transformers' ``...ForCausalLM`` class of a config's family (its ``model_type``): what reads and writes
    the family's Hugging Face files."""
    return getattr(transformers, family_of(config).causal_lm_class)


def training_class(config: Any) -> type:
    """The class canntrain builds the family's model from: its own tree where it has one (GPT-2), else
    transformers' (parameter names and layouts then equal the files')."""
    family = family_of(config)
    return _OWN[family.own_class] if family.own_class else causal_lm_class(config)


def config_from_dict(fields: dict[str, Any], where: str) -> Any:
    """The transformers config of config.json's ``fields`` (its ``model_type`` picks the family; ``where``
    names the file in the error for a type canntrain does not build), with SDPA attention."""
    config = config_class(family_of_model_type(fields.get("model_type"), where)).from_dict(fields)
    config._attn_implementation = "sdpa"
    return config
