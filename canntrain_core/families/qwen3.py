"""Qwen3 (dense): a Llama block with an RMSNorm over each head's query and key (``q_norm``, ``k_norm``),
an explicit ``head_dim`` (128, wider than hidden/heads at the small sizes), no biases; the small sizes
(0.6B-4B) tie the output head to the embedding. transformers' Qwen3ForCausalLM.

The fused attention kernel computes a plain Llama attention (no per-head norms), so Qwen3 keeps
transformers' attention and fuses its norms and MLP only. Under TP each rank's q_norm/k_norm see its own
heads: their weights are replicated over tp and their gradients summed over it (``head_norms``)."""

from __future__ import annotations

from canntrain_core.families.family import TINY_SHAPE, Family


def qwen3_fields(**fields):
    """A public Qwen3's config fields (dense or MoE): head_dim 128, 151,936 tokens, 40,960 positions."""
    return dict(head_dim=128, vocab_size=151936, max_position_embeddings=40960, **fields)


QWEN3 = Family(
    name="qwen3",
    model_types=("qwen3",),
    config_class="Qwen3Config",
    causal_lm_class="Qwen3ForCausalLM",
    tiny="tiny-qwen3",
    common=dict(
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_word_embeddings=False,
        attention_bias=False,
        use_sliding_window=False,
    ),
    qk_norm=True,
    kernel_modules={"Qwen3RMSNorm": "norm", "Qwen3MLP": "mlp"},
    head_norms=("self_attn.q_norm", "self_attn.k_norm"),
    presets={
        "tiny-qwen3": dict(
            TINY_SHAPE,
            head_dim=48,  # wider than hidden / heads (32), as the real small sizes are
        ),
        "qwen3-0.6b": qwen3_fields(
            hidden_size=1024,
            intermediate_size=3072,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
            tie_word_embeddings=True,
        ),
        "qwen3-8b": qwen3_fields(
            hidden_size=4096,
            intermediate_size=12288,
            num_hidden_layers=36,
            num_attention_heads=32,
            num_key_value_heads=8,
        ),
        "qwen3-32b": qwen3_fields(
            hidden_size=5120,
            intermediate_size=25600,
            num_hidden_layers=64,
            num_attention_heads=64,
            num_key_value_heads=8,
        ),
    },
)
