"""A mixture of experts' router loss: what the routers chose in a forward pass, and the load-balancing loss
that training adds (``router_aux_loss_coef`` x it, the family's coefficient).

The loss is Switch Transformer's (Fedus et al., eq. 4-6) as transformers computes it for Mixtral and the Qwen
MoE models: over every layer's routed tokens together, E x sum_i f_i x P_i, where f_i is the share of top-k
assignments that went to expert i and P_i the mean router probability of expert i. Uniform routing gives
top_k; all tokens on one expert, E x top_k. Like transformers' (and Megatron's default), it is computed per
forward pass: per micro-batch and data-parallel rank.
"""

from __future__ import annotations

import torch
from torch import nn


def load_balancing_loss(router_logits: list[torch.Tensor], num_experts: int, top_k: int) -> torch.Tensor:
    """``router_logits``: each layer's [tokens, experts] logits."""
    logits = torch.cat(router_logits).float()
    probs = logits.softmax(dim=-1)
    chosen = probs.topk(top_k, dim=-1).indices
    assigned = torch.zeros(num_experts, device=logits.device).scatter_add_(
        0, chosen.flatten(), torch.ones(chosen.numel(), device=logits.device)
    )
    f = assigned / logits.shape[0]  # assignments per routed token (sums to top_k)
    return num_experts * (f * probs.mean(dim=0)).sum()


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
