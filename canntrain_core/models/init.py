"""Deterministic, layout-independent initial weights for a model that is already sharded.

Why per-parameter seeds, not "build on rank 0 and broadcast": every rank fills its own shards at
once, with no traffic and no rank holding the whole model. Each parameter's full value is drawn from
a generator seeded by (recipe seed, parameter name) on the rank's own device, the rank keeps its
slice (``distribute_tensor(..., src_data_rank=None)`` slices locally, for any FSDP2 / TP placement)
and drops the rest. So a rank holds its shards plus one full parameter at a time (the largest is
the embedding: 32000 x 8192 x 4 B = 1 GiB for Llama-2 70B), and a model initialised under
FSDP2 x TP2 on 4 ranks, or PP2, holds exactly what one process holds (same device type).

The distributions are transformers' own for its families: normal(0, initializer_range) for linear and
embedding weights, zeros for biases, ones for the norm weights (Qwen3's per-head q/k norms too), and for
GPT-2 the residual output projections at initializer_range / sqrt(2 x layers) (``Family.scaled_init``).
"""

from __future__ import annotations

import hashlib
import math

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from canntrain_core.families import family_of
from canntrain_core.models.hf import hf_name


def parameter_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def initial_value(name: str, shape: torch.Size, std: float, seed: int, device: torch.device) -> torch.Tensor:
    """The full fp32 initial value of the parameter called ``name`` (its Hugging Face name)."""
    if name.endswith("norm.weight"):
        return torch.ones(shape, device=device)
    if name.endswith(".bias") or "lora_B" in name:  # a LoRA adapter starts as no change at all
        return torch.zeros(shape, device=device)
    generator = torch.Generator(device=device).manual_seed(parameter_seed(seed, name))
    if "lora_A" in name:  # peft's kaiming-uniform (a = sqrt 5): U(-1/sqrt(fan_in), 1/sqrt(fan_in))
        bound = shape[1] ** -0.5
        return torch.empty(shape, device=device).uniform_(-bound, bound, generator=generator)
    return torch.empty(shape, device=device).normal_(0.0, std, generator=generator)


@torch.no_grad()
def init_weights(model: torch.nn.Module, config, seed: int, only=lambda name: True) -> None:
    """Fill every parameter of a materialized (``to_empty``) model that ``only(name)`` selects, one full
    parameter at a time."""
    scaled = family_of(config).scaled_init
    for name, p in model.named_parameters():
        if not only(name):
            continue
        key = hf_name(name)
        std = config.initializer_range / (math.sqrt(2 * config.num_hidden_layers) if key.endswith(scaled) else 1)
        full = initial_value(key, p.shape, std, seed, p.device)
        if isinstance(p, DTensor):
            full = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None)
        p.copy_(full)
        del full


@torch.no_grad()
def reset_buffers(model: torch.nn.Module, config, device: torch.device) -> None:
    """Recompute the non-persistent buffers (RoPE frequencies) that ``to_empty`` left uninitialised: each
    family's rotary embedding module (transformers' ``...RotaryEmbedding``) rebuilt from the config."""
    for module in model.modules():
        if type(module).__name__.endswith("RotaryEmbedding"):
            with torch.device(device):
                fresh = dict(type(module)(config).named_buffers())
            for name, buf in module.named_buffers():
                buf.copy_(fresh[name])
