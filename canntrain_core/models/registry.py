"""Model presets built on transformers' Llama classes. Random init from a seed; nothing downloaded."""

from __future__ import annotations

from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

# Shapes of the public Llama-2 configs (hidden, intermediate, layers, heads, kv heads).
PRESETS: dict[str, dict[str, Any]] = {
    # A few million parameters: trains on two CPU cores in seconds.
    "tiny": dict(
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=4096,
        max_position_embeddings=2048,
    ),
    "llama2-7b": dict(
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        vocab_size=32000,
        max_position_embeddings=4096,
    ),
    "llama2-13b": dict(
        hidden_size=5120,
        intermediate_size=13824,
        num_hidden_layers=40,
        num_attention_heads=40,
        num_key_value_heads=40,
        vocab_size=32000,
        max_position_embeddings=4096,
    ),
    "llama2-70b": dict(
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        vocab_size=32000,
        max_position_embeddings=4096,
    ),
}

_COMMON = dict(rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, attention_bias=False)


def build_config(preset: str, overrides: dict[str, Any] | None = None, vocab_size: int | None = None) -> LlamaConfig:
    """The transformers LlamaConfig of a preset, with recipe overrides applied.

    ``vocab_size`` (the tokenizer's) wins over the preset's, unless overrides set it.
    """
    if preset not in PRESETS:
        raise KeyError(f"model.preset: unknown preset {preset!r}; known: {', '.join(sorted(PRESETS))}")
    fields = {**_COMMON, **PRESETS[preset]}
    if vocab_size is not None:
        fields["vocab_size"] = vocab_size
    for key, value in (overrides or {}).items():
        if not hasattr(LlamaConfig(), key):
            raise KeyError(f"model.overrides.{key}: not a LlamaConfig field")
        fields[key] = value
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


def count_parameters(model: torch.nn.Module, exclude_embeddings: bool = False) -> int:
    n = sum(p.numel() for p in model.parameters())
    if exclude_embeddings:
        emb = model.get_input_embeddings()
        n -= emb.weight.numel()
    return n
