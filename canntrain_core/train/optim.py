"""AdamW and the learning-rate schedule: linear warmup, then cosine/linear/constant down to min_lr_ratio x lr."""

from __future__ import annotations

import math

import torch

from canntrain_core.recipe import OptimConfig


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    """AdamW; matrices get weight decay, norms and biases (1-D tensors) do not, as in nanoGPT."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    # foreach=False keeps the update order fixed across runs (bit-exact resume) and is as fast on CPU.
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, foreach=False)


def lr_factor(step: int, cfg: OptimConfig) -> float:
    """Multiplier of cfg.lr for optimizer step ``step`` (0-based)."""
    warmup = cfg.warmup
    if warmup and step < warmup:
        return (step + 1) / warmup
    if cfg.scheduler == "constant":
        return 1.0
    decay_steps = max(1, cfg.max_steps - warmup)
    progress = min(1.0, (step - warmup) / decay_steps)
    if cfg.scheduler == "linear":
        shape = 1.0 - progress
    else:  # cosine
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * shape


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, cfg))
