"""GPT-2 with Llama's module names, so that the TP plan, FSDP units, recompute, the pipeline split and the
CausalLM wrapper treat it as every other family (``canntrain_core/families/gpt2.py`` says why, and maps the
names onto transformers' files).

It computes what transformers' GPT2LMHeadModel computes (tests/models/test_families.py compares the logits):
pre-LayerNorm blocks, scaled dot-product attention over q/k/v with biases, a GELU MLP (``activation_function``),
learned absolute positions added to the token embedding, the config's three dropouts, the head tied to the
embedding. Weights are nn.Linear ([out, in]); the files' Conv1D weights are [in, out].
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN


class GPT2Attention(nn.Module):
    def __init__(self, config, layer_idx: int):
        super().__init__()
        h = config.hidden_size
        self.head_dim = h // config.num_attention_heads
        self.layer_idx = layer_idx
        self.scaling = self.head_dim**-0.5 if config.scale_attn_weights else 1.0
        if config.scale_attn_by_inverse_layer_idx:
            self.scaling /= layer_idx + 1
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(h, h) for _ in range(4))
        self.attn_pdrop, self.resid_dropout = config.attn_pdrop, nn.Dropout(config.resid_pdrop)

    def forward(self, hidden_states, attention_mask=None, cache=None, **_):
        # -1 heads: under TP a rank's projections hold its own heads only
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        q, k, v = (proj(hidden_states).view(shape).transpose(1, 2) for proj in (self.q_proj, self.k_proj, self.v_proj))
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=attention_mask,
            dropout_p=self.attn_pdrop if self.training else 0.0,
            is_causal=attention_mask is None,
            scale=self.scaling,
        )
        out = out.transpose(1, 2).reshape(*hidden_states.shape[:-1], -1)
        return self.resid_dropout(self.o_proj(out))


class GPT2MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        h = config.hidden_size
        inner = config.n_inner or 4 * h
        self.up_proj, self.down_proj = nn.Linear(h, inner), nn.Linear(inner, h)
        self.act, self.dropout = ACT2FN[config.activation_function], nn.Dropout(config.resid_pdrop)

    def forward(self, x):
        return self.dropout(self.down_proj(self.act(self.up_proj(x))))


class GPT2Layer(nn.Module):
    def __init__(self, config, layer_idx: int):
        super().__init__()
        eps = config.layer_norm_epsilon
        self.input_layernorm = nn.LayerNorm(config.hidden_size, eps=eps)
        self.self_attn = GPT2Attention(config, layer_idx)
        self.post_attention_layernorm = nn.LayerNorm(config.hidden_size, eps=eps)
        self.mlp = GPT2MLP(config)

    def forward(self, hidden_states, attention_mask=None, cache=None, **_):
        # hidden_states by name: sequence parallel's plan gathers the attention's input by that keyword
        normed = self.input_layernorm(hidden_states)
        h = hidden_states + self.self_attn(hidden_states=normed, attention_mask=attention_mask, cache=cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class GPT2Backbone(nn.Module):
    rotary_emb = None  # learned absolute positions instead

    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_positions = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.drop = nn.Dropout(config.embd_pdrop)
        self.layers = nn.ModuleList(GPT2Layer(config, i) for i in range(config.num_hidden_layers))
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)


class GPT2ForTraining(nn.Module):
    """GPT-2 as canntrain trains it: ``model`` (the backbone) and ``lm_head``, tied when the config says so.
    ``models.init`` fills it (GPT-2's scheme: the family's ``scaled_init``)."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.model = GPT2Backbone(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens
