"""parallelize: apply a recipe's layout to a CausalLM in torchtitan's order.

PP split -> tensor parallel -> expert parallel -> context parallel -> activation recompute -> torch.compile ->
FSDP2 / DDP.
Returns the pipeline schedule when pipeline parallel is on, else None.
"""

from __future__ import annotations

import torch

from canntrain_core.parallel.context import apply_context_parallel
from canntrain_core.parallel.data_parallel import apply_ddp, apply_fsdp
from canntrain_core.parallel.expert import route_experts
from canntrain_core.parallel.pp import build_schedule, split_stage
from canntrain_core.parallel.recompute import apply_recompute
from canntrain_core.parallel.tp import apply_tp
from canntrain_kernels.block_attention import BlockAttention, eager_block_attention


def parallelize(
    model, mesh, dims, recipe, device: torch.device, trainable: bool = True, ring_block: BlockAttention | None = None
):
    """``trainable=False``: a frozen model (a reference, a reward model) is sharded like the trained one but
    never wrapped by DDP, which has no gradient to synchronise and refuses a module without one. ``ring_block``:
    the kernel registry's ``attention_block`` the recipe selects for context parallel's ring (default: eager).
    The parallel settings come from ``recipe.layout`` (the validator's and the estimator's reading too); the
    model's own (recompute, compile, expert capacity) from ``recipe.model``."""
    layout = recipe.layout
    if dims.pp > 1:
        split_stage(model, mesh.get_local_rank("pp"), dims.pp)
    if dims.tp > 1:
        apply_tp(model, mesh["tp"], layout.sequence_parallel, layout.vocab_parallel)
    if dims.ep > 1 or recipe.model.expert_capacity_factor is not None:
        route_experts(model, mesh["ep"] if dims.ep > 1 else None, recipe.model.expert_capacity_factor)
    if dims.cp > 1:
        apply_context_parallel(model, mesh["cp"].get_group(), ring_block or eager_block_attention, dims.pp > 1)
    apply_recompute(model, recipe.model.activation_checkpointing)
    if recipe.model.compile:
        for layer in model.layers():
            layer.compile()
    if dims.fsdp_ranks > 1:
        apply_fsdp(
            model,
            dims.shard_mesh(mesh),
            layout.zero,
            layout.precision,
            layout.offload_optimizer,
            pipeline=dims.pp > 1,
            expert_mesh=mesh["dp_shard_mod_ep"] if dims.ep > 1 else None,
        )
    elif dims.dp_replicate > 1 and trainable:
        apply_ddp(model, mesh["dp_replicate"])
    if dims.pp > 1:
        return build_schedule(model, mesh["pp"], device, layout.pipeline_schedule, layout.microbatches)
    return None
