"""Data parallelism: FSDP2 (`fully_shard`) for zero_optimization 1-3, DDP (`replicate`) for 0.

ZeRO stages map onto FSDP2 like this (documented, not identical):
- 3: parameters, gradients and optimizer states sharded; parameters re-gathered for backward
  (reshard_after_forward=True) -- ZeRO-3;
- 2: the same sharding, but parameters stay gathered between forward and backward -- ZeRO-2's
  traffic; gradients are reduce-scattered after every micro-batch, so they stay sharded;
- 1: as 2, and under gradient accumulation the parameters stay gathered and the gradients
  unsharded until the step's last micro-batch: one gather and one reduce-scatter per step, for
  ZeRO-1's memory (full gradients) -- see :func:`sync_gradients`.
Under pipeline parallel nothing is resharded after forward (torchtitan's rule: each micro-batch's
backward would gather the stage again), and torch's schedule defers the reduce-scatter to the
step's last micro-batch itself.

With 16-bit precision FSDP2 gathers bf16/fp16 parameters and reduces fp32 gradients
(``MixedPrecisionPolicy``): the fp32 master weights stay sharded for the optimizer, no autocast copy
of a weight is made, and the gathers move half the bytes. ``optim.offload_optimizer`` keeps the
sharded parameters, gradients and optimizer states in host memory (``CPUOffloadPolicy``); the
optimizer step runs there.
"""

from __future__ import annotations

import torch
from torch.distributed._composable.replicate import replicate
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from canntrain_core.parallel.expert import experts_of
from canntrain_core.runtime.accelerator import HALF_DTYPES


def apply_fsdp(
    model,
    dp_mesh: DeviceMesh,
    zero_stage: int,
    precision: str = "fp32",
    offload: bool = False,
    pipeline: bool = False,
    expert_mesh: DeviceMesh | None = None,
) -> None:
    """``expert_mesh`` (expert parallel: dp_shard_mod_ep): experts already split over ``ep`` are sharded over it
    alone (``parallel.expert`` scales their gradients for the ep ranks' share)."""
    reshard = zero_stage >= 3 and not pipeline
    kwargs = {
        "mesh": dp_mesh,
        "reshard_after_forward": reshard,
        "mp_policy": MixedPrecisionPolicy(param_dtype=HALF_DTYPES[precision], reduce_dtype=torch.float32)
        if precision in HALF_DTYPES
        else MixedPrecisionPolicy(),
        # pinned host memory only pays (and only exists) with an accelerator to copy to
        "offload_policy": CPUOffloadPolicy(pin_memory=dp_mesh.device_type != "cpu") if offload else OffloadPolicy(),
    }
    for layer in model.layers():
        experts = experts_of(layer) if expert_mesh is not None else None
        if experts is not None:
            fully_shard(experts, **{**kwargs, "mesh": expert_mesh})
        fully_shard(layer, **kwargs)
    # The root keeps embedding, final norm and head: it is gathered for the whole forward.
    fully_shard(model, **kwargs)


def apply_ddp(model, dp_mesh: DeviceMesh) -> None:
    replicate(model, device_mesh=dp_mesh)


def sync_gradients(model, zero_stage: int, last: bool) -> None:
    """Before a micro-batch's backward: synchronise gradients only on the step's last one, where that
    saves traffic without breaking a ZeRO stage's memory (DDP, FSDP2 ZeRO-1); ZeRO-2/3 reduce-scatter
    every micro-batch to keep gradients sharded. Pipeline schedules handle this themselves."""
    if isinstance(model, FSDPModule):
        if zero_stage == 1:
            model.set_requires_gradient_sync(last)
            model.set_reshard_after_backward(last)
    elif hasattr(model, "set_requires_gradient_sync"):  # replicate() (DDP)
        model.set_requires_gradient_sync(last)
