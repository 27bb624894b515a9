"""How many bytes each strategy moves per optimizer step, per device: the analytic side of
`benchmarks/parallel_overhead.py`, which measures the same traffic on the loopback interface.

Ring collectives over n ranks move, per device: all-reduce 2(n-1)/n x size, all-gather and
reduce-scatter (n-1)/n x size (size = the full, unsharded tensor). Pipeline stages send activations
forward and their gradients backward at each stage boundary, once per micro-batch.
"""

from __future__ import annotations

from canntrain_core.runtime.distributed import ParallelDims


def _layer_params(config) -> int:
    h = config.hidden_size
    kv = config.num_key_value_heads * (h // config.num_attention_heads)
    return 2 * h * h + 2 * h * kv + 3 * h * config.intermediate_size + 2 * h


def comm_per_step(config, dims: ParallelDims, batch_size: int, seq_length: int, grad_accum: int,
                  zero_stage: int, param_bytes: int = 4, act_bytes: int = 4, backend: str = "nccl",
                  sequence_parallel: bool = False) -> list[dict]:
    """Rows of (strategy, collective, calls per step, bytes sent per device per step).

    ``backend="gloo"``: gloo has no reduce-scatter, so it falls back to an all-reduce (twice the bytes).
    """
    layers = config.num_hidden_layers
    h = config.hidden_size
    params = layers * _layer_params(config) + 2 * config.vocab_size * h + h
    params_per_stage = params / dims.pp
    rows = []
    tp_local = params_per_stage  # parameters outside TP's sharding are few for Llama: count all once
    rs_factor = 2 if backend == "gloo" else 1  # gloo has no reduce-scatter: an all-reduce instead
    if dims.tp > 1 and sequence_parallel:
        t = dims.tp
        acts = batch_size * seq_length * h * act_bytes
        # Each of the two TP regions per layer: all-gather in, reduce-scatter out (forward), and the
        # mirror in backward; the embedding's and the final norm's gathers are left out (2 per step).
        calls = 4 * (layers // dims.pp) * grad_accum
        rows.append({"strategy": "TP+SP", "collective": "all-gather (activations)", "calls": calls,
                     "bytes": calls * (t - 1) / t * acts})
        rows.append({"strategy": "TP+SP", "collective": "reduce-scatter (activations)", "calls": calls,
                     "bytes": rs_factor * calls * (t - 1) / t * acts})
        tp_local = params_per_stage / t
    elif dims.tp > 1:
        t = dims.tp
        acts = batch_size * seq_length * h * act_bytes
        # Forward: after o_proj and after down_proj. Backward: each column-parallel projection
        # (q, k, v, gate, up) all-reduces its input gradient; Megatron fuses qkv and gate/up into 2.
        per_layer = 2 + 5
        calls = per_layer * (layers // dims.pp) * grad_accum
        rows.append({"strategy": "TP", "collective": "all-reduce (activations)", "calls": calls,
                     "bytes": calls * 2 * (t - 1) / t * acts})
        tp_local = params_per_stage / t
    n = dims.dp
    if n > 1:
        grads = tp_local * param_bytes
        if dims.dp_shard > 1:
            gathers = 2 if zero_stage >= 3 else 1  # ZeRO-3 gathers again for backward
            rows.append({"strategy": "FSDP", "collective": "all-gather (parameters)",
                         "calls": gathers * grad_accum, "bytes": gathers * grad_accum * (n - 1) / n * grads})
            rows.append({"strategy": "FSDP", "collective": "reduce-scatter (gradients)",
                         "calls": grad_accum, "bytes": rs_factor * grad_accum * (n - 1) / n * grads})
        else:
            rows.append({"strategy": "DP", "collective": "all-reduce (gradients)",
                         "calls": grad_accum, "bytes": grad_accum * 2 * (n - 1) / n * grads})
    if dims.pp > 1:
        micro = grad_accum
        acts = batch_size * seq_length * h * act_bytes
        # Averaged over stages: each boundary carries activations forward and gradients back.
        boundary_bytes = 2 * micro * acts * (dims.pp - 1) / dims.pp
        rows.append({"strategy": "PP", "collective": "send/recv (activations, gradients)",
                     "calls": 2 * micro, "bytes": boundary_bytes})
    return rows
