"""Mistral 7B: the Llama block (GQA with 8 KV heads, SwiGLU, RMSNorm); v0.3's 32,768-token vocabulary and
RoPE theta 1e6, no sliding window; v0.1's 4,096-token ``sliding_window`` (``model.overrides`` or its
config.json) windows every layer. transformers' MistralForCausalLM."""

from __future__ import annotations

from canntrain_core.families.family import TINY_SHAPE, Family

MISTRAL = Family(
    name="mistral",
    model_types=("mistral",),
    config_class="MistralConfig",
    causal_lm_class="MistralForCausalLM",
    tiny="tiny-mistral",
    common=dict(rms_norm_eps=1e-5, rope_theta=1000000.0, tie_word_embeddings=False, sliding_window=None),
    qkv_bias=lambda c: False,
    o_bias=lambda c: False,
    kernel_modules={"MistralRMSNorm": "norm", "MistralMLP": "mlp", "MistralAttention": "attention"},
    presets={
        "tiny-mistral": dict(
            TINY_SHAPE,
            head_dim=32,
        ),
        "mistral-7b": dict(
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            vocab_size=32768,
            max_position_embeddings=32768,
        ),
    },
)
