"""Gradient-norm clipping that works when gradients are DTensors (FSDP2/TP) or split over pipeline stages.

Same arithmetic as torch.nn.utils.clip_grad_norm_ (so single-process results do not change), with
each DTensor's norm completed over its mesh and the total summed over pipeline stages.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def clip_grad_norm(params, max_norm: float | None, pp_group=None) -> torch.Tensor:
    """Global L2 norm of all gradients (across shards and stages); scale them down to max_norm."""
    params = [p for p in params if p.grad is not None]
    grads = [p.grad for p in params]
    if not grads:
        return torch.zeros(())
    if pp_group is None and not any(isinstance(g, DTensor) for g in grads):
        return torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm is not None else math.inf)
    norms = []
    for g in grads:
        n = torch.linalg.vector_norm(g, 2.0)
        norms.append(n.full_tensor() if isinstance(n, DTensor) else n)  # full_tensor sums the shards
    total = torch.linalg.vector_norm(torch.stack(norms), 2.0)
    if pp_group is not None:
        square = total**2
        dist.all_reduce(square, group=pp_group)  # each stage holds different parameters
        total = square.sqrt()
    if max_norm is not None and math.isfinite(max_norm):
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef.item() if isinstance(g, DTensor) else coef)
    return total
