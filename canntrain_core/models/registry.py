"""Model configs from presets (each family's transformers classes, ``canntrain_core/families/``) or from an
init_from directory. Random init from a seed; nothing downloaded."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from canntrain_core.errors import BadInput
from canntrain_core.families import family_of, family_of_preset
from canntrain_core.models.classes import config_class, training_class
from canntrain_core.models.hf import check_against_recipe, check_weights, read_config
from canntrain_core.models.init import init_weights
from canntrain_core.recipe import no_model_named
from canntrain_core.sizing.presets import PRESETS, preset_fields


def build_config(preset: str, overrides: dict[str, Any] | None = None, vocab_size: int | None = None):
    """The transformers config of a preset (its family's class), with recipe overrides applied.

    ``vocab_size`` (the tokenizer's) wins over the preset's, unless overrides set it.
    """
    fields = preset_fields(preset, overrides, vocab_size)
    cls = config_class(family_of_preset(preset))
    known = preset_fields(preset)  # a field the family's presets set (Qwen3-MoE's head_dim: not a config default)
    for key in overrides or {}:
        if not hasattr(cls(), key) and key not in known:
            raise KeyError(f"model.overrides.{key}: not a {cls.__name__} field")
    _check_rope(fields.get("rope_parameters") or fields.get("rope_scaling"), "model.overrides")  # before transformers
    config = cls(**fields)
    config._attn_implementation = "sdpa"
    return config


def model_config(m, vocab_size: int | None = None):
    """The architecture a recipe's ``model`` section describes: ``model.init_from``'s config.json
    (checked against a preset set explicitly, against ``model.overrides`` and against its tensors), else the preset with
    overrides and the tokenizer's ``vocab_size``."""
    if m.init_from:
        config = read_config(m.init_from)
        family = family_of(config).name
        if m.type is not None and m.type != family:
            raise BadInput(f"model.type={m.type}, but {Path(m.init_from) / 'config.json'} holds a {family} model")
        preset = PRESETS[m.preset] if m.preset else None
        check_against_recipe(config, preset, m.overrides, Path(m.init_from))
        _check_built(config, Path(m.init_from) / "config.json")
        check_weights(config, m.init_from)  # the safetensors are what config.json says
        return config
    if m.preset is None:
        raise no_model_named()
    config = build_config(m.preset, m.overrides, vocab_size)
    _check_built(config, "model.overrides")
    return config


def _check_built(config, where) -> None:
    """One line naming what of ``config`` its family does not build (families.family.Family.not_built), or a RoPE
    variant this transformers does not know (a config a newer one wrote)."""
    why = family_of(config).not_built(config)
    if why:
        raise BadInput(f"{where}: {why}")
    _check_rope(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None), where)


def _check_rope(rope, where) -> None:
    """A RoPE variant this transformers does not know (a config a newer one wrote) is named, not a KeyError later."""
    rope_type = rope.get("rope_type", rope.get("type")) if isinstance(rope, dict) else None
    if rope_type not in (None, "default") and rope_type not in ROPE_INIT_FUNCTIONS:
        raise BadInput(
            f"{where}: rope_type {rope_type!r} is not one transformers {transformers.__version__} knows "
            f"({', '.join(sorted(ROPE_INIT_FUNCTIONS))} or default): a config written by a newer transformers?"
        )


def build_model(
    preset: str,
    overrides: dict[str, Any] | None = None,
    vocab_size: int | None = None,
    seed: int = 0,
    device: str | torch.device = "cpu",
) -> torch.nn.Module:
    """A transformers-initialised model of a preset on one device, for kernel tests and as the
    transformers baseline in benchmarks. Training builds through ``models.lifecycle`` instead (on
    meta, sharded, then each rank fills its own part). ``device="meta"`` builds the shape only."""
    config = build_config(preset, overrides, vocab_size)
    if torch.device(device).type == "meta":
        with torch.device("meta"):
            return training_class(config)(config)
    # Seed a private generator-free block so model init never depends on earlier RNG use.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = training_class(config)(config)
    if family_of(config).own_class:  # canntrain's own tree: its init is models.init's
        init_weights(model, config, seed)
    return model.to(device)


def count_parameters(model: torch.nn.Module, exclude_embeddings: bool = False, trainable_only: bool = False) -> int:
    """Parameters of a model, each once (a tied head is the embedding), DTensors counted whole: the one count
    the notebooks, LoRA's summary and the benchmarks read."""
    n = sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)
    if exclude_embeddings:
        emb = model.get_input_embeddings()
        n -= emb.weight.numel()
    return n
