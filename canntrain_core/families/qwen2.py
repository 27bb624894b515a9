"""Qwen2 and Qwen2.5: a Llama block with biases on the q, k and v projections (not on o), RoPE theta 1e6,
a 151,936/152,064-token vocabulary; the small sizes (0.5B-3B) tie the output head to the embedding.
transformers' Qwen2ForCausalLM. ``use_sliding_window`` windows the layers from ``max_window_layers`` on
(``family.layer_windows``)."""

from __future__ import annotations

from canntrain_core.families.family import TINY_SHAPE, Family


def _qwen25(**fields):
    return dict(max_position_embeddings=32768, **fields)


QWEN2 = Family(
    name="qwen2",
    model_types=("qwen2",),
    config_class="Qwen2Config",
    causal_lm_class="Qwen2ForCausalLM",
    tiny="tiny-qwen2",
    common=dict(rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False, use_sliding_window=False),
    qkv_bias=lambda c: True,
    o_bias=lambda c: False,
    kernel_modules={"Qwen2RMSNorm": "norm", "Qwen2MLP": "mlp", "Qwen2Attention": "attention"},
    presets={
        "tiny-qwen2": dict(
            TINY_SHAPE,
            tie_word_embeddings=True,
        ),
        "qwen2.5-0.5b": _qwen25(
            hidden_size=896,
            intermediate_size=4864,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            vocab_size=151936,
            tie_word_embeddings=True,
        ),
        "qwen2.5-7b": _qwen25(
            hidden_size=3584,
            intermediate_size=18944,
            num_hidden_layers=28,
            num_attention_heads=28,
            num_key_value_heads=4,
            vocab_size=152064,
        ),
        "qwen2.5-72b": _qwen25(
            hidden_size=8192,
            intermediate_size=29568,
            num_hidden_layers=80,
            num_attention_heads=64,
            num_key_value_heads=8,
            vocab_size=152064,
        ),
    },
)
