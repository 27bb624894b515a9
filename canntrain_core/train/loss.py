"""The language-model loss, owned here (not inside transformers) so a fused kernel can replace it."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def plain_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss from final hidden states [N, h], the output projection [V, h] and targets [N].

    Materialises the full [N, V] logits in fp32; kernels' chunked cross_entropy has the same signature.
    """
    logits = hidden @ weight.t()
    return F.cross_entropy(logits.float(), targets)


def causal_lm_loss(model, input_ids: torch.Tensor, targets: torch.Tensor, cross_entropy=plain_cross_entropy):
    """Loss of a transformers *ForCausalLM on already-shifted targets (targets[t] = input_ids[t+1])."""
    hidden = model.model(input_ids=input_ids, use_cache=False).last_hidden_state
    return cross_entropy(hidden.flatten(0, 1), model.lm_head.weight, targets.flatten())
