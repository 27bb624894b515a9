"""Llama 2 and Llama 3 (3.1, 3.2): RMSNorm, RoPE (llama3 scaling from 3.1 on), SwiGLU, grouped-query
attention; Llama 3.2's 1B and 3B tie the output head to the embedding. transformers' LlamaForCausalLM."""

from __future__ import annotations

from canntrain_core.families.family import TINY_SHAPE, Family

# The llama3 rope scaling of Llama 3.1 and 3.2 (transformers' rope_type "llama3"); each preset sets its factor.
_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def _llama3(**fields):
    return dict(vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0, **fields)


LLAMA = Family(
    name="llama",
    model_types=("llama",),
    config_class="LlamaConfig",
    tiny="tiny",
    causal_lm_class="LlamaForCausalLM",
    common=dict(rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, attention_bias=False),
    kernel_modules={"LlamaRMSNorm": "norm", "LlamaMLP": "mlp", "LlamaAttention": "attention"},
    presets={
        # A few million parameters: trains on two CPU cores in seconds.
        "tiny": dict(
            TINY_SHAPE,
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
        "llama3-8b": _llama3(
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            rope_scaling=_LLAMA3_ROPE | {"factor": 8.0},
        ),
        "llama3-70b": _llama3(
            hidden_size=8192,
            intermediate_size=28672,
            num_hidden_layers=80,
            num_attention_heads=64,
            num_key_value_heads=8,
            rope_scaling=_LLAMA3_ROPE | {"factor": 8.0},
        ),
        # Llama 3.2's small models tie the output head to the embedding (a quarter of the 1B's parameters).
        "llama3.2-1b": _llama3(
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=16,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=64,
            rope_scaling=_LLAMA3_ROPE | {"factor": 32.0},
            tie_word_embeddings=True,
        ),
        "llama3.2-3b": _llama3(
            hidden_size=3072,
            intermediate_size=8192,
            num_hidden_layers=28,
            num_attention_heads=24,
            num_key_value_heads=8,
            head_dim=128,
            rope_scaling=_LLAMA3_ROPE | {"factor": 32.0},
            tie_word_embeddings=True,
        ),
    },
)
