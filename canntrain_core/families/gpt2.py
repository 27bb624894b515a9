"""GPT-2: LayerNorm (weight and bias), learned absolute positions, a GELU MLP without a gate, biases on every
projection, the output head tied to the embedding. transformers' GPT2LMHeadModel reads and writes the files.

Its tree does not split over TP as it stands: transformers' ``Conv1D`` stores each weight transposed
([in, out]) and fuses q, k and v into one ``c_attn`` whose column blocks a plain row split would cut across
heads. canntrain builds GPT-2 with Llama's module names (``models/gpt2.py``: q/k/v/o_proj, up/down_proj,
nn.Linear) and maps the names and layouts onto the files' here (``hf_names``): c_attn's three column blocks
are q, k and v, each transposed. LoRA is not built for it (peft's GPT-2 adapters wrap the fused c_attn).
"""

from __future__ import annotations

from canntrain_core.families.family import TINY_SHAPE, Family, HFName


def _gpt2(hidden: int, layers: int, heads: int) -> dict:
    return dict(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, n_inner=4 * hidden)


_LAYER = r"model\.layers\.(\d+)\."
GPT2 = Family(
    name="gpt2",
    model_types=("gpt2",),
    config_class="GPT2Config",
    causal_lm_class="GPT2LMHeadModel",
    own_class="GPT2ForTraining",
    tiny="tiny-gpt2",
    shape_kind="gpt",
    config_keys={"intermediate_size": "n_inner", "num_key_value_heads": ""},
    # Presets name the sizes by Llama's keys (GPT2Config maps them onto n_embd, n_layer, n_head, n_positions;
    # n_inner has no such alias). Pretraining without dropout, as nanoGPT does (GPT-2's own files say 0.1).
    common=dict(
        vocab_size=50257,
        max_position_embeddings=1024,
        activation_function="gelu_new",
        layer_norm_epsilon=1e-5,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=None,
    ),
    qkv_bias=lambda c: True,
    o_bias=lambda c: True,
    scaled_init=("self_attn.o_proj.weight", "mlp.down_proj.weight"),
    hf_names=(
        HFName(r"model\.embed_tokens\.weight", "transformer.wte.weight"),
        HFName(r"model\.embed_positions\.weight", "transformer.wpe.weight"),
        HFName(r"model\.norm\.(weight|bias)", "transformer.ln_f.{0}"),
        HFName(_LAYER + r"input_layernorm\.(weight|bias)", "transformer.h.{0}.ln_1.{1}"),
        HFName(_LAYER + r"post_attention_layernorm\.(weight|bias)", "transformer.h.{0}.ln_2.{1}"),
        HFName(_LAYER + r"self_attn\.q_proj\.weight", "transformer.h.{0}.attn.c_attn.weight", transposed=True, parts=3),
        HFName(
            _LAYER + r"self_attn\.k_proj\.weight",
            "transformer.h.{0}.attn.c_attn.weight",
            transposed=True,
            part=1,
            parts=3,
        ),
        HFName(
            _LAYER + r"self_attn\.v_proj\.weight",
            "transformer.h.{0}.attn.c_attn.weight",
            transposed=True,
            part=2,
            parts=3,
        ),
        HFName(_LAYER + r"self_attn\.q_proj\.bias", "transformer.h.{0}.attn.c_attn.bias", parts=3),
        HFName(_LAYER + r"self_attn\.k_proj\.bias", "transformer.h.{0}.attn.c_attn.bias", part=1, parts=3),
        HFName(_LAYER + r"self_attn\.v_proj\.bias", "transformer.h.{0}.attn.c_attn.bias", part=2, parts=3),
        HFName(_LAYER + r"self_attn\.o_proj\.weight", "transformer.h.{0}.attn.c_proj.weight", transposed=True),
        HFName(_LAYER + r"self_attn\.o_proj\.bias", "transformer.h.{0}.attn.c_proj.bias"),
        HFName(_LAYER + r"mlp\.up_proj\.weight", "transformer.h.{0}.mlp.c_fc.weight", transposed=True),
        HFName(_LAYER + r"mlp\.up_proj\.bias", "transformer.h.{0}.mlp.c_fc.bias"),
        HFName(_LAYER + r"mlp\.down_proj\.weight", "transformer.h.{0}.mlp.c_proj.weight", transposed=True),
        HFName(_LAYER + r"mlp\.down_proj\.bias", "transformer.h.{0}.mlp.c_proj.bias"),
    ),
    presets={
        # The Llama tiny preset's width, depth and heads with GPT-2's 4x MLP (no GQA: GPT-2 has none).
        "tiny-gpt2": dict(
            hidden_size=TINY_SHAPE["hidden_size"],
            num_hidden_layers=TINY_SHAPE["num_hidden_layers"],
            num_attention_heads=TINY_SHAPE["num_attention_heads"],
            n_inner=4 * TINY_SHAPE["hidden_size"],
            vocab_size=TINY_SHAPE["vocab_size"],
            max_position_embeddings=TINY_SHAPE["max_position_embeddings"],
        ),
        "gpt2": _gpt2(768, 12, 12),  # 124M
        "gpt2-medium": _gpt2(1024, 24, 16),  # 355M
        "gpt2-large": _gpt2(1280, 36, 20),  # 774M
        "gpt2-xl": _gpt2(1600, 48, 25),  # 1.5B
    },
)
