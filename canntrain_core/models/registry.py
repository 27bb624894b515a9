"""Model presets built on transformers' Llama classes. Random init from a seed; nothing downloaded.

The presets themselves are data in ``canntrain_core/sizing/presets.py``."""

from __future__ import annotations

from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from canntrain_core.sizing.presets import PRESETS, preset_fields


def build_config(preset: str, overrides: dict[str, Any] | None = None, vocab_size: int | None = None) -> LlamaConfig:
    """The transformers LlamaConfig of a preset, with recipe overrides applied.

    ``vocab_size`` (the tokenizer's) wins over the preset's, unless overrides set it.
    """
    fields = preset_fields(preset, overrides, vocab_size)
    for key in overrides or {}:
        if not hasattr(LlamaConfig(), key):
            raise KeyError(f"model.overrides.{key}: not a LlamaConfig field")
    config = LlamaConfig(**fields)
    config._attn_implementation = "sdpa"
    return config


def model_config(m, vocab_size: int | None = None) -> LlamaConfig:
    """The architecture a recipe's ``model`` section describes: ``model.init_from``'s config.json
    (checked against a preset set explicitly, against ``model.overrides`` and against its tensors), else the preset with
    overrides and the tokenizer's ``vocab_size``."""
    if m.init_from:
        from pathlib import Path

        from canntrain_core.models.hf import check_against_recipe, check_weights, read_config

        config = read_config(m.init_from)
        preset = PRESETS[m.preset] if "preset" in m.model_fields_set else None
        check_against_recipe(config, preset, m.overrides, Path(m.init_from))
        check_weights(config, m.init_from)  # the safetensors are what config.json says
        return config
    return build_config(m.preset, m.overrides, vocab_size)


def build_model(
    preset: str,
    overrides: dict[str, Any] | None = None,
    vocab_size: int | None = None,
    seed: int = 0,
    device: str | torch.device = "cpu",
) -> LlamaForCausalLM:
    """A transformers-initialised Llama of a preset on one device, for kernel tests and as the
    transformers baseline in benchmarks. Training builds through ``models.lifecycle`` instead (on
    meta, sharded, then each rank fills its own part). ``device="meta"`` builds the shape only."""
    config = build_config(preset, overrides, vocab_size)
    if torch.device(device).type == "meta":
        with torch.device("meta"):
            return LlamaForCausalLM(config)
    # Seed a private generator-free block so model init never depends on earlier RNG use.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model.to(device)


def count_parameters(model: torch.nn.Module, exclude_embeddings: bool = False, trainable_only: bool = False) -> int:
    """Parameters of a model, each once (a tied head is the embedding), DTensors counted whole: the one count
    the notebooks, LoRA's summary and the benchmarks read."""
    n = sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)
    if exclude_embeddings:
        emb = model.get_input_embeddings()
        n -= emb.weight.numel()
    return n
