"""Qwen1.5-MoE and Qwen2-MoE: the Qwen2 block (biases on q, k and v) with its MLP replaced by a router over
``num_experts`` SwiGLU experts of ``moe_intermediate_size``, ``num_experts_per_tok`` active, their weights the
router's softmax probabilities (``norm_topk_prob`` false), plus one shared expert every token goes through (a
SwiGLU MLP of ``shared_expert_intermediate_size``) scaled by a sigmoid gate (``shared_expert_gate``, one output).
transformers' Qwen2MoeForCausalLM; the files hold each expert's gate_proj, up_proj and down_proj.

Expert parallelism splits the routed experts only: the shared expert is an ordinary MLP that FSDP2 shards with the
attention. Training adds ``router_aux_loss_coef`` x the load-balancing loss (0.001). As for Qwen3-MoE, a config
with dense MLP layers among the sparse ones is refused in one line.
"""

from __future__ import annotations

from canntrain_core.families.family import TINY_SHAPE, Family
from canntrain_core.families.qwen2 import QWEN2
from canntrain_core.families.qwen3_moe import QWEN3_MOE

QWEN2_MOE = Family(
    name="qwen2_moe",
    model_types=("qwen2_moe",),
    config_class="Qwen2MoeConfig",
    causal_lm_class="Qwen2MoeForCausalLM",
    tiny="tiny-qwen2-moe",
    shape_kind="moe",
    config_keys=QWEN3_MOE.config_keys,
    common=dict(
        QWEN2.common, norm_topk_prob=False, router_aux_loss_coef=0.001, mlp_only_layers=[], decoder_sparse_step=1
    ),
    qkv_bias=lambda c: bool(getattr(c, "qkv_bias", True)),
    o_bias=lambda c: False,
    kernel_modules={
        "Qwen2MoeRMSNorm": "norm",
        "Qwen2MoeMLP": "mlp",
        "Qwen2MoeAttention": "attention",
        "Qwen2MoeExperts": "experts",
    },
    router_class="Qwen2MoeTopKRouter",
    not_built=QWEN3_MOE.not_built,
    hf_names=QWEN3_MOE.hf_names,  # the same files' names for the routed experts; the shared expert's are ours
    presets={
        # the tiny Qwen2 attention with 8 experts of a third of the dense tiny MLP's width (2 active) and a shared
        # expert of two thirds
        "tiny-qwen2-moe": dict(
            TINY_SHAPE,
            moe_intermediate_size=128,
            shared_expert_intermediate_size=256,
            num_experts=8,
            num_experts_per_tok=2,
        ),
        "qwen1.5-moe-a2.7b": dict(
            hidden_size=2048,
            intermediate_size=5632,
            moe_intermediate_size=1408,
            shared_expert_intermediate_size=5632,
            num_hidden_layers=24,
            num_attention_heads=16,
            num_key_value_heads=16,
            num_experts=60,
            num_experts_per_tok=4,
            vocab_size=151936,
            max_position_embeddings=8192,
        ),
        "qwen2-57b-a14b": dict(
            hidden_size=3584,
            intermediate_size=18944,
            moe_intermediate_size=2560,
            shared_expert_intermediate_size=20480,
            num_hidden_layers=28,
            num_attention_heads=28,
            num_key_value_heads=4,
            num_experts=64,
            num_experts_per_tok=8,
            vocab_size=151936,
            max_position_embeddings=32768,
        ),
    },
)
