"""transformers' classes of a family (``canntrain_core/families/``), by the names the family gives them."""

from __future__ import annotations

from typing import Any

import transformers

from canntrain_core.families import Family, family_of, family_of_model_type


def config_class(family: Family) -> type:
    return getattr(transformers, family.config_class)


def causal_lm_class(config: Any) -> type:
    """The ``...ForCausalLM`` class of a transformers config's family (its ``model_type``)."""
    return getattr(transformers, family_of(config).causal_lm_class)


def config_from_dict(fields: dict[str, Any], where: str) -> Any:
    """The transformers config of config.json's ``fields`` (its ``model_type`` picks the family; ``where``
    names the file in the error for a type canntrain does not build), with SDPA attention."""
    config = config_class(family_of_model_type(fields.get("model_type"), where)).from_dict(fields)
    config._attn_implementation = "sdpa"
    return config
