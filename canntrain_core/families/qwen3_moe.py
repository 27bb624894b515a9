"""Qwen3-MoE: the Qwen3 block (an RMSNorm over each head's query and key, an explicit ``head_dim``) with its MLP
replaced by a router over ``num_experts`` SwiGLU experts of ``moe_intermediate_size``, ``num_experts_per_tok``
active, their weights renormalised (``norm_topk_prob``); no shared expert. transformers' Qwen3MoeForCausalLM
(its experts two 3-D tensors, as Mixtral's); the files hold each expert's gate_proj, up_proj and down_proj.

Training adds ``router_aux_loss_coef`` x the load-balancing loss (0.001, Qwen's; transformers' formula, as for
Mixtral). canntrain builds every layer sparse: a config with dense MLP layers among them (``mlp_only_layers``,
``decoder_sparse_step`` > 1) is refused in one line (the estimator counts a uniform stack of blocks).
"""

from __future__ import annotations

from canntrain_core.families.family import TINY_SHAPE, Family, HFName
from canntrain_core.families.qwen3 import QWEN3, qwen3_fields

_MOE = r"model\.layers\.(\d+)\.mlp\.experts\."
_FILE = "model.layers.{0}.mlp.experts.{e}."


def _dense_layers(config) -> str:
    if getattr(config, "mlp_only_layers", None) or getattr(config, "decoder_sparse_step", 1) != 1:
        return (
            "mlp_only_layers / decoder_sparse_step: dense MLP layers among the experts' are not built (canntrain "
            "builds every layer sparse: mlp_only_layers [] and decoder_sparse_step 1)"
        )
    return ""


def _qwen3_moe(**fields):
    return qwen3_fields(num_experts=128, **fields)


QWEN3_MOE = Family(
    name="qwen3_moe",
    model_types=("qwen3_moe",),
    config_class="Qwen3MoeConfig",
    causal_lm_class="Qwen3MoeForCausalLM",
    tiny="tiny-qwen3-moe",
    shape_kind="moe",
    config_keys={"intermediate_size": "moe_intermediate_size", "experts_per_token": "num_experts_per_tok"},
    common=dict(
        QWEN3.common, norm_topk_prob=True, router_aux_loss_coef=0.001, mlp_only_layers=[], decoder_sparse_step=1
    ),
    qk_norm=QWEN3.qk_norm,
    kernel_modules={"Qwen3MoeRMSNorm": "norm", "Qwen3MoeExperts": "experts"},
    head_norms=QWEN3.head_norms,
    router_class="Qwen3MoeTopKRouter",
    not_built=_dense_layers,
    hf_names=(
        HFName(_MOE + r"gate_up_proj", _FILE + "gate_proj.weight", parts=2, experts=True),
        HFName(_MOE + r"gate_up_proj", _FILE + "up_proj.weight", part=1, parts=2, experts=True),
        HFName(_MOE + r"down_proj", _FILE + "down_proj.weight", experts=True),
    ),
    presets={
        # Qwen3's tiny attention (head_dim 48) with 8 experts of a third of the dense tiny MLP's width, 2 active
        "tiny-qwen3-moe": dict(
            TINY_SHAPE,
            head_dim=48,
            moe_intermediate_size=128,
            num_experts=8,
            num_experts_per_tok=2,
        ),
        "qwen3-30b-a3b": _qwen3_moe(
            hidden_size=2048,
            intermediate_size=6144,
            moe_intermediate_size=768,
            num_hidden_layers=48,
            num_attention_heads=32,
            num_key_value_heads=4,
            num_experts_per_tok=8,
        ),
        "qwen3-235b-a22b": _qwen3_moe(
            hidden_size=4096,
            intermediate_size=12288,
            moe_intermediate_size=1536,
            num_hidden_layers=94,
            num_attention_heads=64,
            num_key_value_heads=4,
            num_experts_per_tok=8,
        ),
    },
)
