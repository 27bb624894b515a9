"""Model presets as data: the transformers LlamaConfig fields of each named shape.

``models/registry.py`` builds LlamaConfigs from them; the recipe schema checks ``model.preset``
against them; the memory estimator derives a :class:`~canntrain_core.sizing.shapes.ModelShape`
from them without importing transformers.
"""

from __future__ import annotations

from typing import Any

# The llama3 rope scaling of Llama 3.1 and 3.2 (transformers' rope_type "llama3"); each preset sets its factor.
_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

# Shapes of the public Llama-2 and Llama-3 configs (hidden, intermediate, layers, heads, kv heads, ...).
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
    # Llama 3.1's public configs (3's 8k-context models have the same tensors): GQA with 8 KV heads, a
    # 128,256-token vocabulary, rope theta 500,000 stretched to 128k positions by the llama3 rope scaling.
    "llama3-8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=131072,
        rope_theta=500000.0,
        rope_scaling=_LLAMA3_ROPE | {"factor": 8.0},
    ),
    "llama3-70b": dict(
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=131072,
        rope_theta=500000.0,
        rope_scaling=_LLAMA3_ROPE | {"factor": 8.0},
    ),
    # Llama 3.2's small models tie the output head to the embedding (a quarter of the 1B's parameters).
    "llama3.2-1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        vocab_size=128256,
        max_position_embeddings=131072,
        rope_theta=500000.0,
        rope_scaling=_LLAMA3_ROPE | {"factor": 32.0},
        tie_word_embeddings=True,
    ),
    "llama3.2-3b": dict(
        hidden_size=3072,
        intermediate_size=8192,
        num_hidden_layers=28,
        num_attention_heads=24,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=128256,
        max_position_embeddings=131072,
        rope_theta=500000.0,
        rope_scaling=_LLAMA3_ROPE | {"factor": 32.0},
        tie_word_embeddings=True,
    ),
}

# LlamaConfig fields every preset shares.
COMMON: dict[str, Any] = dict(rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, attention_bias=False)


def preset_fields(
    preset: str, overrides: dict[str, Any] | None = None, vocab_size: int | None = None
) -> dict[str, Any]:
    """The config fields of a preset with recipe overrides applied: :data:`COMMON`, the preset's, then
    ``vocab_size`` (the tokenizer's), then ``overrides`` (which win over the tokenizer's vocab size).
    Raises KeyError for an unknown preset; override keys are not checked here (the model builder
    checks them against LlamaConfig)."""
    if preset not in PRESETS:
        raise KeyError(f"model.preset: unknown preset {preset!r}; known: {', '.join(sorted(PRESETS))}")
    fields = {**COMMON, **PRESETS[preset]}
    if vocab_size is not None:
        fields["vocab_size"] = vocab_size
    fields.update(overrides or {})
    return fields
