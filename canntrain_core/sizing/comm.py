"""How many bytes each strategy moves per optimizer step, per device: the one traffic model, used by the
planner's step time and by `benchmarks/parallel_overhead.py`, which measures the same traffic on the
loopback interface.

Ring collectives over n ranks move, per device: all-reduce 2(n-1)/n x size, all-gather and
reduce-scatter (n-1)/n x size (size = the full, unsharded tensor). Pipeline stages send activations
forward and their gradients backward at each stage boundary, once per micro-batch.

When gradients are synchronised (``parallel/data_parallel.py`` and the trainer's step):

- DDP (ZeRO-0): one all-reduce per optimizer step, however many micro-batches accumulate;
- FSDP2 ZeRO-1: parameters gathered once and gradients reduce-scattered once per step (both stay
  unsharded between the step's micro-batches: ZeRO-1 holds full gradients anyway);
- FSDP2 ZeRO-2 / ZeRO-3: a reduce-scatter per micro-batch, so gradients stay sharded (holding them
  unsharded across micro-batches would cost the full model's gradients on every rank, torchtitan's
  reason for the same choice); ZeRO-2 gathers parameters once per micro-batch, ZeRO-3 twice;
- under pipeline parallel, torch's schedule keeps FSDP's parameters gathered and its gradients
  unsharded until the step's last backward: one gather, one reduce-scatter per step.

Under 16-bit precision FSDP2 gathers 16-bit parameters (its MixedPrecisionPolicy) and reduces fp32
gradients; DDP reduces fp32 gradients; activations cross TP and PP boundaries in 16 bits.
"""

from __future__ import annotations

from typing import Any

from canntrain_core.sizing.shapes import ModelShape, shape_of


def fsdp_syncs_once_per_step(zero_stage: int, pp: int) -> bool:
    """Whether FSDP2 keeps parameters gathered and gradients unsharded over a step's micro-batches."""
    return zero_stage == 1 or pp > 1


def comm_per_step(
    model,
    dims: Any,
    batch_size: int,
    seq_length: int,
    grad_accum: int,
    zero_stage: int,
    precision: str = "fp32",
    backend: str = "nccl",
    sequence_parallel: bool = False,
    vocab_parallel: bool = True,
) -> list[dict]:
    """Rows of (strategy, collective, calls per step, bytes sent per device per step).

    ``model``: a ModelShape or a transformers config. ``dims``: the parallel sizes, anything with ``pp``, ``tp``,
    ``dp`` and ``dp_shard`` (a sizing.layout.Layout, or a runtime.distributed.ParallelDims).
    ``grad_accum``: micro-batches per step.
    ``backend="gloo"``: gloo has no reduce-scatter, so it falls back to an all-reduce (twice the bytes).
    ``vocab_parallel`` (the trainer's default, ``distributed.vocab_parallel``): under TP the embedding's output
    is summed over tp (a reduce-scatter under SP) and, in backward, the head's input gradient; the loss
    all-reduces three fp32 floats a token (the softmax's max and sum, the target's logit).
    """
    shape: ModelShape = model if isinstance(model, ModelShape) else shape_of(model)
    half = precision in ("bf16", "fp16")
    act_bytes = 2 if half else 4
    layers, h = shape.num_layers, shape.hidden_size
    params_per_stage = shape.num_params() / dims.pp
    rows = []
    tp_local = params_per_stage  # parameters outside TP's sharding are few for Llama: count all once
    rs_factor = 2 if backend == "gloo" else 1  # gloo has no reduce-scatter: an all-reduce instead
    acts = batch_size * seq_length * h * act_bytes
    moe = shape.kind == "moe"  # its MoE block is not split over tp (parallel/tp.py): one TP region per layer
    # parameters on one tp rank: all split over tp, except a mixture of experts' blocks
    replicated = shape.tp_replicated_params() / dims.pp
    if dims.tp > 1 and sequence_parallel:
        t = dims.tp
        # Each TP region per layer (attention, the MLP): all-gather in, reduce-scatter out (forward), and the
        # mirror in backward; a MoE block gathers its input in forward and its output's gradient in backward.
        # The embedding's and the final norm's gathers are left out (2 per step).
        calls = 4 * (layers // dims.pp) * grad_accum
        scatters = calls // 2 if moe else calls
        rows.append(
            {
                "strategy": "TP+SP",
                "collective": "all-gather (activations)",
                "calls": calls,
                "bytes": calls * (t - 1) / t * acts,
            }
        )
        rows.append(
            {
                "strategy": "TP+SP",
                "collective": "reduce-scatter (activations)",
                "calls": scatters,
                "bytes": rs_factor * scatters * (t - 1) / t * acts,
            }
        )
    elif dims.tp > 1:
        t = dims.tp
        # Forward: after o_proj and after down_proj. Backward: each column-parallel projection
        # (q, k, v, gate, up) all-reduces its input gradient; Megatron fuses qkv and gate/up into 2.
        # A mixture of experts: attention's only (1 + 3).
        per_layer = 1 + 3 if moe else 2 + 5
        calls = per_layer * (layers // dims.pp) * grad_accum
        rows.append(
            {
                "strategy": "TP",
                "collective": "all-reduce (activations)",
                "calls": calls,
                "bytes": calls * 2 * (t - 1) / t * acts,
            }
        )
    if dims.tp > 1:
        tp_local = (params_per_stage - replicated) / dims.tp + replicated
    if dims.tp > 1 and vocab_parallel:
        t, label = dims.tp, "TP+SP" if sequence_parallel else "TP"
        embed = (rs_factor if sequence_parallel else 2) * (t - 1) / t * acts
        rows.append(
            {
                "strategy": label,
                "collective": "all-reduce (vocabulary-parallel embedding output, head input gradient)",
                "calls": 2 * grad_accum,
                "bytes": grad_accum * (embed + 2 * (t - 1) / t * acts),
            }
        )
        rows.append(
            {
                "strategy": label,
                "collective": "all-reduce (vocabulary-parallel loss)",
                "calls": 3 * grad_accum,
                "bytes": 3 * grad_accum * 2 * (t - 1) / t * batch_size * seq_length * 4,
            }
        )
    n, ep = dims.dp, getattr(dims, "ep", 1)
    if ep > 1:
        # parallel/expert.py: each MoE layer's dispatch and combine, and their mirrors in backward; even routing
        # sends (ep-1)/ep of a rank's (token, k) rows away (the per-expert counts exchanged first are left out)
        calls = 4 * (layers // dims.pp) * grad_accum
        routed = batch_size * seq_length * shape.experts_per_token * h * act_bytes
        rows.append(
            {
                "strategy": "EP",
                "collective": "all-to-all (routed tokens)",
                "calls": calls,
                "bytes": calls * (ep - 1) / ep * routed,
            }
        )
    if n > 1:
        # FSDP2 shards the rank's experts over dp/ep ranks, everything else over dp (parallel/data_parallel.py)
        experts = shape.expert_params() / dims.pp
        fsdp_share = (tp_local - experts) * (n - 1) / n + experts / ep * (n // ep - 1) / (n // ep)
        grads = tp_local * 4  # gradients reduce in fp32
        if dims.dp_shard > 1:
            if fsdp_syncs_once_per_step(zero_stage, dims.pp):
                gathers, scatters = 1, 1
            else:
                gathers, scatters = (2 if zero_stage >= 3 else 1) * grad_accum, grad_accum
            rows.append(
                {
                    "strategy": "FSDP",
                    "collective": "all-gather (parameters)",
                    "calls": gathers,
                    "bytes": gathers * fsdp_share * (2 if half else 4),  # MixedPrecisionPolicy: 16-bit parameters
                }
            )
            rows.append(
                {
                    "strategy": "FSDP",
                    "collective": "reduce-scatter (gradients)",
                    "calls": scatters,
                    "bytes": rs_factor * scatters * fsdp_share * 4,
                }
            )
        else:
            rows.append(
                {"strategy": "DP", "collective": "all-reduce (gradients)", "calls": 1, "bytes": 2 * (n - 1) / n * grads}
            )
    if dims.pp > 1:
        # Averaged over stages: each boundary carries activations forward and gradients back.
        boundary_bytes = 2 * grad_accum * acts * (dims.pp - 1) / dims.pp
        rows.append(
            {
                "strategy": "PP",
                "collective": "send/recv (activations, gradients)",
                "calls": 2 * grad_accum,
                "bytes": boundary_bytes,
            }
        )
    return rows
