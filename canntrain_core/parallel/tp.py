"""Tensor parallelism (Megatron style) on the Llama decoder layers.

Column-parallel q/k/v and gate/up projections, row-parallel o and down projections: each
layer does one all-reduce after attention and one after the MLP. Heads are split across the
`tp` ranks (transformers' attention infers the local head count from the projection width).
Embedding, final norm and output head stay replicated, so sequence parallelism and loss
parallelism are not applied here: they save activation memory, which the estimator counts.
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

LAYER_PLAN = {
    "self_attn.q_proj": ColwiseParallel,
    "self_attn.k_proj": ColwiseParallel,
    "self_attn.v_proj": ColwiseParallel,
    "self_attn.o_proj": RowwiseParallel,
    "mlp.gate_proj": ColwiseParallel,
    "mlp.up_proj": ColwiseParallel,
    "mlp.down_proj": RowwiseParallel,
}


def apply_tp(model, tp_mesh: DeviceMesh) -> None:
    for layer in model.layers():
        parallelize_module(layer, tp_mesh, {name: style() for name, style in LAYER_PLAN.items()})
