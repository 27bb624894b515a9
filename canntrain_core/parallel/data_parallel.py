"""Data parallelism: FSDP2 (`fully_shard`) for zero_optimization 1-3, DDP (`replicate`) for 0.

ZeRO stages map onto FSDP2 like this (documented, not identical):
- 3: parameters, gradients and optimizer states sharded; parameters re-gathered for backward
  (reshard_after_forward=True) -- ZeRO-3;
- 1 and 2: the same sharding but parameters stay gathered between forward and backward
  (reshard_after_forward=False), trading memory for one all-gather less -- ZeRO-2's traffic.
"""

from __future__ import annotations

from torch.distributed._composable.replicate import replicate
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard


def apply_fsdp(model, dp_mesh: DeviceMesh, zero_stage: int) -> None:
    reshard = zero_stage >= 3
    for layer in model.layers():
        fully_shard(layer, mesh=dp_mesh, reshard_after_forward=reshard)
    # The root keeps embedding, final norm and head: it is gathered for the whole forward.
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard)


def apply_ddp(model, dp_mesh: DeviceMesh) -> None:
    replicate(model, device_mesh=dp_mesh)
