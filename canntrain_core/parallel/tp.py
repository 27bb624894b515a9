"""Tensor parallelism (Megatron style) on the decoder layers, with optional sequence parallelism.

Column-parallel q/k/v and gate/up projections (their biases, Qwen2's, split with them), row-parallel o and
down projections: each layer all-reduces after attention and after the MLP. Heads are split across the `tp`
ranks (transformers' attention infers the local head count from the projection width). Every family of
``canntrain_core/families/`` names its layers as Llama does (GPT-2's MLP has no gate: a plan entry applies
where the layer has the module); a norm applied per head (Qwen3's q_norm and
k_norm, ``Family.head_norms``) sees only its rank's heads, so its weight is replicated over tp and its
gradient summed over it (torch's SequenceParallel style, the split being the heads' dimension).

A mixture of experts splits attention only: its MoE block runs whole on every tp rank (expert parallelism,
``parallel.expert``, is what splits the experts).

Sequence parallel (``distributed.sequence_parallel``, Megatron's SP): between those regions the
activations stay split along the sequence, so the norms and residual adds run on 1/tp of the
tokens and store 1/tp of the activations; each all-reduce becomes a reduce-scatter plus an
all-gather (the same bytes); the final hidden states are gathered before the head.

The embedding and the output head (``distributed.vocab_parallel``, on by default) are split over the
vocabulary, and the loss is computed on each rank's slice of the logits (``parallel.vocab``): at Llama 3's
128,256 or Qwen's 151,936 entries the head and its fp32 logits are a large share of a rank's memory.
With ``vocab_parallel: false`` they stay replicated (every tp rank computes the whole loss).
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from canntrain_core.families import family_of
from canntrain_core.parallel.vocab import shard_embedding

LAYER_PLAN = {
    "self_attn.q_proj": ColwiseParallel,
    "self_attn.k_proj": ColwiseParallel,
    "self_attn.v_proj": ColwiseParallel,
    "self_attn.o_proj": RowwiseParallel,
    "mlp.gate_proj": ColwiseParallel,
    "mlp.up_proj": ColwiseParallel,
    "mlp.down_proj": RowwiseParallel,
}


def _sequence_parallel_layer_plan() -> dict:
    # The projections receive the gathered input as a DTensor (use_local_output=False), so their
    # input gradients add up as one Partial tensor and leave as one reduce-scatter, not an
    # all-reduce per projection.
    gather = dict(desired_input_layouts=(Replicate(),), use_local_output=False)
    return {
        "input_layernorm": SequenceParallel(),
        "self_attn": PrepareModuleInput(
            input_kwarg_layouts={"hidden_states": Shard(1)},
            desired_input_kwarg_layouts={"hidden_states": Replicate()},
            use_local_output=False,
        ),
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
        "post_attention_layernorm": SequenceParallel(),
        "mlp": PrepareModuleInput(input_layouts=(Shard(1),), **gather),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
    }


# A mixture of experts' block (router, experts, shared expert) is not split over tp: every tp rank runs it whole
# on the whole sequence (its input and output identical on the tp ranks, so are its parameters' gradients); under
# sequence parallel its input is gathered along the sequence and its output split again.
_MOE_UNDER_SP = PrepareModuleInputOutput(
    input_layouts=(Shard(1),),
    desired_input_layouts=(Replicate(),),
    use_local_input=True,
    output_layouts=(Replicate(),),
    desired_output_layouts=(Shard(1),),
    use_local_output=True,
)


def _has(layer, name: str) -> bool:
    try:
        layer.get_submodule(name)
        return True
    except AttributeError:
        return False


def _head_norm_plan(config) -> dict:
    """The family's per-head norms: their input [batch, seq, local heads, head_dim] is split over the heads."""
    return {name: SequenceParallel(sequence_dim=2, use_local_output=True) for name in family_of(config).head_norms}


def apply_vocab_parallel(model, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
    """The embedding and the output head split over the vocabulary (rows): a rank looks up the ids in its rows
    (the others' give zeros, summed over tp: split along the sequence under SP); the loss reads the head's rows
    (``parallel.vocab``) and only a call for logits (evaluation, generation) gathers them."""
    m = model.model
    if m.embed_tokens is not None:
        shard_embedding(m.embed_tokens, tp_mesh, sequence_parallel)
    if model.lm_head is not None and model.lm_head.out_features % tp_mesh.size() == 0:  # not a one-row scalar head
        parallelize_module(model.lm_head, tp_mesh, ColwiseParallel(output_layouts=Replicate()))


def apply_tp(model, tp_mesh: DeviceMesh, sequence_parallel: bool = False, vocab_parallel: bool = False) -> None:
    head_norms = _head_norm_plan(model.config)
    if vocab_parallel:
        apply_vocab_parallel(model, tp_mesh, sequence_parallel)
    if not sequence_parallel:
        for layer in model.layers():
            plan = {name: style() for name, style in LAYER_PLAN.items() if _has(layer, name)}
            parallelize_module(layer, tp_mesh, {**plan, **head_norms})
        return
    m = model.model
    if m.embed_tokens is not None and not vocab_parallel:  # replicated embedding; output split along the sequence
        parallelize_module(
            m.embed_tokens,
            tp_mesh,
            PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1), use_local_output=True),
        )
    if getattr(m, "embed_positions", None) is not None:  # GPT-2's positions: split along the sequence as the tokens
        parallelize_module(
            m.embed_positions,
            tp_mesh,
            PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1), use_local_output=True),
        )
    if m.norm is not None:  # the final norm on the last pipeline stage; CausalLM gathers its output
        parallelize_module(m.norm, tp_mesh, SequenceParallel())
    for layer in model.layers():
        plan = {name: style for name, style in _sequence_parallel_layer_plan().items() if _has(layer, name)}
        if hasattr(layer.mlp, "experts"):
            plan["mlp"] = _MOE_UNDER_SP
        parallelize_module(layer, tp_mesh, {**plan, **_head_norm_plan(model.config)})
