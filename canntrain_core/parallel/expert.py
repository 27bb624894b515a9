"""Expert parallelism: each rank of an ``ep`` group holds ``num_experts / ep`` of a layer's experts, and each
token travels to the ranks of its top-k experts and back (torchtitan's scheme, on transformers' MoE blocks).

A layer's experts are two 3-D tensors (transformers' ``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I]),
sharded on their first dimension over ``ep`` as DTensors (so checkpoints reshard across EP sizes and the
seeded init and ``init_from`` fill each rank's experts as for any placement). The forward:

1. dispatch: sort the (token, k) pairs by expert, exchange the per-expert counts, then the tokens, with
   ``all_to_all_single`` and uneven splits (one exchange forward, the reverse one in backward);
2. run this rank's experts on the tokens it received, grouped by expert: the kernel registry's ``expert_mlp``
   (a loop on CPU; the device's grouped matmul where the recipe's kernels pick it);
3. combine: the reverse exchange, each result back at its (token, k) position, weighted by the router.

FSDP2 shards each rank's experts further over ``dp_shard_mod_ep`` (``data_parallel.apply_fsdp``) and averages
their gradients over it; every ``ep`` rank's tokens reached them too, so their gradient is divided by ``ep`` on
the way back (torchtitan sets FSDP2's divide factor instead: a PREMUL_SUM reduction, which gloo does not have).
"""

from __future__ import annotations

import types

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from canntrain_core.models.moe import expert_capacity
from canntrain_kernels.reference import expert_mlp as reference_expert_mlp

EXPERT_TENSORS = ("gate_up_proj", "down_proj")


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with uneven splits; its backward is the reverse exchange."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


def within_capacity(top_k_index: torch.Tensor, top_k_weights: torch.Tensor, capacity: int, num_experts: int):
    """Which (token, k) pairs their expert takes when each takes at most ``capacity``: the highest router weights
    first (Megatron's "probs" drop policy). A bool tensor shaped like ``top_k_index``."""
    flat = top_k_index.reshape(-1)
    by_weight = torch.argsort(top_k_weights.reshape(-1), descending=True, stable=True)
    order = by_weight[torch.argsort(flat[by_weight], stable=True)]  # by expert, then by weight, highest first
    counts = torch.bincount(flat, minlength=num_experts)
    first = counts.cumsum(0) - counts  # each expert's first place in ``order``
    place = torch.empty_like(order)
    place[order] = torch.arange(len(order), device=flat.device) - first[flat[order]]
    return (place < capacity).view_as(top_k_index)


def dispatch(x: torch.Tensor, top_k_index: torch.Tensor, num_experts: int, group, keep: torch.Tensor | None = None):
    """Send each (token, k) pair to the rank holding its expert (``group`` None: every expert is here). ``keep``:
    the pairs within their expert's capacity, the others are not sent. Returns the rows this rank's experts take,
    grouped by local expert, their counts per local expert (a tensor, as the expert kernels take it), and what
    ``combine`` needs to send results back."""
    ep = dist.get_world_size(group) if group is not None else 1
    local = num_experts // ep
    flat = top_k_index.reshape(-1)
    if keep is not None:
        flat = torch.where(keep.reshape(-1), flat, num_experts)  # a dropped pair sorts past the last expert
    order = torch.argsort(flat, stable=True)  # by expert, so by destination rank
    counts = torch.bincount(flat, minlength=num_experts + 1)[:num_experts]
    order = order[: int(counts.sum())]
    send = x[order // top_k_index.shape[1]]
    if group is None:
        return send, counts, (order, None, None, None, None)
    received_counts = torch.empty_like(counts)
    dist.all_to_all_single(received_counts, counts, group=group)  # [source rank][local expert]
    in_splits = counts.view(ep, local).sum(1).tolist()
    out_splits = received_counts.view(ep, local).sum(1).tolist()
    received = _AllToAll.apply(send, out_splits, in_splits, group)  # by source rank, then local expert
    by_source = received_counts.view(ep, local)
    expert_of_row = torch.repeat_interleave(torch.arange(local, device=x.device).repeat(ep), by_source.reshape(-1))
    regroup = torch.argsort(expert_of_row, stable=True)
    return received[regroup], by_source.sum(0), (order, regroup, in_splits, out_splits, group)


def combine(y: torch.Tensor, state, pairs: int) -> torch.Tensor:
    """The inverse of ``dispatch``: each row of ``y`` back on the rank and at the (token, k) place it came from,
    as [pairs, hidden] in ``top_k_index``'s order (zeros where a pair was dropped)."""
    order, regroup, in_splits, out_splits, group = state
    if group is not None:
        y = _AllToAll.apply(y[torch.argsort(regroup)], in_splits, out_splits, group)
    return y.new_zeros((pairs, y.shape[1])).index_copy(0, order, y)


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the gradient times ``scale``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


def _local(p: torch.Tensor, ep: int) -> torch.Tensor:
    """This rank's experts of ``p`` (a DTensor sharded over ep), the gradient averaged over the ep ranks' tokens."""
    p = p.to_local() if isinstance(p, DTensor) else p
    return p if ep == 1 else _ScaleGrad.apply(p, 1.0 / ep)


def _forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
    """transformers' experts' forward (same arguments; the same result when nothing is dropped) with the experts
    spread over ``ep`` and at most ``capacity_factor`` x an even share of the pairs per expert."""
    keep = None
    if self.capacity_factor is not None:
        capacity = expert_capacity(len(top_k_index), self.num_experts, top_k_index.shape[1], self.capacity_factor)
        keep = within_capacity(top_k_index, top_k_weights, capacity, self.num_experts)
    tokens, counts, state = dispatch(hidden_states, top_k_index, self.num_experts, self.ep_group, keep)
    ep = dist.get_world_size(self.ep_group) if self.ep_group is not None else 1
    y = self.expert_kernel(tokens, counts, _local(self.gate_up_proj, ep), _local(self.down_proj, ep))
    out = combine(y, state, top_k_index.numel()).view(*top_k_index.shape, -1) * top_k_weights[..., None]
    return out.sum(1).to(hidden_states.dtype)


def experts_of(layer: nn.Module) -> nn.Module | None:
    """A decoder layer's experts (transformers' ``mlp.experts``: 3-D expert tensors), or None for a dense MLP."""
    experts = getattr(layer.mlp, "experts", None)
    return experts if experts is not None and hasattr(experts, EXPERT_TENSORS[0]) else None


def routed(experts: nn.Module, kernel=None) -> None:
    """Make ``experts`` run canntrain's forward, its experts by ``kernel`` (the registry's expert_mlp; None:
    the one already chosen, else the reference loop). Keeps an ep group or capacity already set."""
    if getattr(experts.act_fn, "__name__", type(experts.act_fn).__name__) not in ("silu", "SiLU", "SiLUActivation"):
        raise ValueError(f"canntrain's experts compute SwiGLU; this model's experts use {experts.act_fn}")
    experts.ep_group = getattr(experts, "ep_group", None)
    experts.capacity_factor = getattr(experts, "capacity_factor", None)
    experts.expert_kernel = kernel or getattr(experts, "expert_kernel", reference_expert_mlp)
    experts.forward = types.MethodType(_forward, experts)


def route_experts(model: nn.Module, ep_mesh: DeviceMesh | None, capacity_factor: float | None) -> None:
    """Every layer's experts run canntrain's forward: sharded over ``ep_mesh`` on the expert dimension (None: all
    here) with tokens sent to them and back, each expert taking at most ``capacity_factor`` x an even share of
    the (token, k) pairs (None: every pair, as transformers' experts)."""
    for layer in model.layers():
        experts = experts_of(layer)
        if experts is None:
            continue
        if ep_mesh is not None:
            for name in EXPERT_TENSORS:
                full = getattr(experts, name)
                experts.register_parameter(
                    name, nn.Parameter(distribute_tensor(full, ep_mesh, [Shard(0)], src_data_rank=None))
                )
        experts.ep_group = ep_mesh.get_group() if ep_mesh is not None else None
        experts.capacity_factor = capacity_factor
        routed(experts)
    model.capacity_factor = capacity_factor
