"""A mixture of experts' router loss: what the routers chose in a forward pass, and the load-balancing loss
that training adds (``router_aux_loss_coef`` x it, the family's coefficient).

The loss is Switch Transformer's (Fedus et al., eq. 4-6) as transformers computes it for Mixtral and the Qwen
MoE models: over every layer's routed tokens together, E x sum_i f_i x P_i, where f_i is the share of top-k
assignments that went to expert i and P_i the mean router probability of expert i. Uniform routing gives
top_k; all tokens on one expert, E x top_k. Like transformers' (and Megatron's default), it is computed per
forward pass: per micro-batch and data-parallel rank.
"""

from __future__ import annotations

import math

import torch
from torch import nn


def expert_tokens(router_logits: list[torch.Tensor], num_experts: int, top_k: int) -> torch.Tensor:
    """[layers, experts]: how many (token, k) assignments each layer's router gave each expert (its top-k)."""
    chosen = torch.stack([logits.topk(top_k, dim=-1).indices.flatten() for logits in router_logits])
    counts = torch.zeros(len(router_logits), num_experts, dtype=torch.long, device=chosen.device)
    return counts.scatter_add_(1, chosen, torch.ones_like(chosen))  # not bincount: a fixed shape, for fake mode


def load_balancing_loss(router_logits: list[torch.Tensor], counts: torch.Tensor) -> torch.Tensor:
    """``router_logits``: each layer's [tokens, experts] logits; ``counts``: their ``expert_tokens``."""
    probs = torch.cat(router_logits).float().softmax(dim=-1)
    f = counts.sum(0) / probs.shape[0]  # per routed token: sums to top_k
    return counts.shape[1] * (f * probs.mean(dim=0)).sum()


def expert_capacity(tokens: int, num_experts: int, top_k: int, factor: float) -> int:
    """How many (token, k) assignments one expert takes from ``tokens`` tokens at capacity factor ``factor``:
    ``factor`` x an even share (Megatron's ``moe_expert_capacity_factor``, GShard's capacity)."""
    return math.ceil(factor * tokens * top_k / num_experts)


def dropped_tokens(counts: torch.Tensor, tokens: int, top_k: int, factor: float) -> torch.Tensor:
    """[layers]: the assignments over their expert's capacity (what the experts' forward leaves out), from each
    layer's ``expert_tokens`` counts over ``tokens`` tokens."""
    capacity = expert_capacity(tokens, counts.shape[1], top_k, factor)
    return (counts - capacity).clamp(min=0).sum(1)


class RouterRecorder:
    """Keeps the router logits of every router module (class ``router_class``) during a forward pass."""

    def __init__(self, model: nn.Module, router_class: str):
        self.logits: list[torch.Tensor] = []
        self.routers = [m for m in model.modules() if type(m).__name__ == router_class]
        for router in self.routers:
            router.register_forward_hook(self._keep)

    def _keep(self, module, args, output) -> None:
        self.logits.append(output[0])

    def take(self) -> list[torch.Tensor]:
        logits, self.logits = self.logits, []
        return logits
