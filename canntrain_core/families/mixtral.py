"""Mixtral: the Mistral block with its MLP replaced by a sparse mixture of experts: a router (``mlp.gate``)
picks ``num_experts_per_tok`` of ``num_local_experts`` SwiGLU experts for each token and mixes their outputs
by its renormalised probabilities. transformers' MixtralForCausalLM (its experts stored as two 3-D tensors,
``mlp.experts.gate_up_proj`` and ``mlp.experts.down_proj``).

Training adds the router's load-balancing loss (Switch Transformer's, as transformers computes it) times
``router_aux_loss_coef`` (``models.moe.load_balancing_loss``). Expert parallelism splits the experts
(``parallel.expert``); tensor parallelism only the attention (``parallel.tp``); pipeline parallelism is not built
for MoE yet (a pipeline stage's router loss would not reach the schedule's loss).
"""

from __future__ import annotations

from canntrain_core.families.family import TINY_SHAPE, Family, HFName

# transformers keeps a layer's experts as two 3-D tensors; Mixtral's files (and transformers' save_pretrained) hold
# each expert's w1 (gate), w3 (up) and w2 (down) and call the block block_sparse_moe.
_MOE = r"model\.layers\.(\d+)\.mlp\."
_FILE = "model.layers.{0}.block_sparse_moe."
MIXTRAL = Family(
    name="mixtral",
    model_types=("mixtral",),
    config_class="MixtralConfig",
    causal_lm_class="MixtralForCausalLM",
    tiny="tiny-moe",
    shape_kind="moe",
    config_keys={"num_experts": "num_local_experts", "experts_per_token": "num_experts_per_tok"},
    common=dict(rms_norm_eps=1e-5, rope_theta=1000000.0, tie_word_embeddings=False, sliding_window=None),
    qkv_bias=lambda c: False,
    o_bias=lambda c: False,
    kernel_modules={"MixtralRMSNorm": "norm", "MixtralAttention": "attention", "MixtralExperts": "experts"},
    router_class="MixtralTopKRouter",
    hf_names=(
        HFName(_MOE + r"gate\.weight", _FILE + "gate.weight"),
        HFName(_MOE + r"experts\.gate_up_proj", _FILE + "experts.{e}.w1.weight", parts=2, experts=True),
        HFName(_MOE + r"experts\.gate_up_proj", _FILE + "experts.{e}.w3.weight", part=1, parts=2, experts=True),
        HFName(_MOE + r"experts\.down_proj", _FILE + "experts.{e}.w2.weight", experts=True),
    ),
    presets={
        # The Llama tiny preset's attention with 8 experts of a third the width, 2 active: about the dense tiny
        # MLP's FLOPs per token, four times its expert parameters.
        "tiny-moe": dict(
            TINY_SHAPE,
            intermediate_size=128,
            num_local_experts=8,
            num_experts_per_tok=2,
            router_aux_loss_coef=0.02,
        ),
        "mixtral-8x7b": dict(
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            vocab_size=32000,
            max_position_embeddings=32768,
            num_local_experts=8,
            num_experts_per_tok=2,
            router_aux_loss_coef=0.02,
        ),
        "mixtral-8x22b": dict(
            hidden_size=6144,
            intermediate_size=16384,
            num_hidden_layers=56,
            num_attention_heads=48,
            num_key_value_heads=8,
            vocab_size=32768,
            max_position_embeddings=65536,
            num_local_experts=8,
            num_experts_per_tok=2,
            router_aux_loss_coef=0.001,
        ),
    },
)
