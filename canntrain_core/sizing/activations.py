"""Saved-activation bytes of one transformer block, counted tensor by tensor.

The counts follow what autograd keeps for the model code canntrain runs (transformers' Llama
with sdpa, the loss in canntrain_core/models/lm.py), per token of one micro-batch:

fp32 (no autocast), llama block::

    norms    x, normalized n, weighted y (x3, twice)        24h + 8   (+8: two rsqrt values)
    attn     q 4h, k 4kv, v 4kv, out 4h, logsumexp 4a       8h + 8kv + 4a
    mlp      gate 4i, up 4i, silu 4i, silu*up 4i            16i

bf16/fp16 under autocast: the residual stream and the RMSNorm math stay fp32 (x, n: 16h + 8);
every linear saves its own 16-bit cast of its input (q, k, v: 3 x 2h; gate, up: 2 x 2h; none under FSDP2's
MixedPrecisionPolicy, whose layers receive 16-bit inputs); attention
and MLP tensors are 16-bit (4h + 4kv + 4a + 8i); and autocast's cached 16-bit copy of every weight
matrix is saved for backward (2 bytes per weight, per micro-batch in flight).

This is the same bookkeeping as the textbook s*b*h*(34 + 5*a*s/h) (Korthikanti et al. 2022) for a
GPT block in 16-bit with dropout; for llama with flash attention there is no a*s^2 term. With
tensor parallel and sequence parallel everything is divided by tp; without sequence parallel the
norm/residual part and the linear-input casts stay whole on each rank.
"""

from __future__ import annotations

from dataclasses import dataclass

from canntrain_core.sizing.setup import TrainSetup
from canntrain_core.sizing.shapes import ModelShape


@dataclass(frozen=True)
class LayerActivations:
    """Bytes one block keeps for backward for one micro-batch on one rank."""

    tensors: int  # saved activations
    weight_copies: int  # autocast's 16-bit weight copies (0 without autocast)

    @property
    def total(self) -> int:
        return self.tensors + self.weight_copies


def _per_token(shape: ModelShape, setup: TrainSetup) -> tuple[float, float, float]:
    """(replicated, tp-sharded, MLP) bytes per token of one block, before recompute. The MLP's are split over tp
    with the attention's, except a mixture of experts' (its block runs whole on every tp rank)."""
    h, i, kv, a = shape.hidden_size, shape.intermediate_size, shape.kv_size, shape.num_heads
    half = setup.precision != "fp32" and not setup.weights_16bit  # autocast over fp32 weights
    if shape.kind == "gpt":  # LayerNorm keeps mean and rstd; GELU keeps its input; no gate
        mlp_fp32, mlp_half = 8 * i, 4 * i + 2 * i  # fc out, gelu out ; half: + cast of proj input
    else:
        mlp_fp32, mlp_half = 16 * i, 8 * i
    if shape.kind == "moe":  # each token visits experts_per_token experts and the shared one; router logits fp32
        mlp_fp32 = mlp_fp32 * shape.experts_per_token + 16 * shape.shared_expert_size + 4 * shape.num_experts
        mlp_half = mlp_half * shape.experts_per_token + 8 * shape.shared_expert_size + 4 * shape.num_experts
    if setup.precision == "fp32":
        replicated = 24 * h + 8
        sharded, mlp = 8 * h + 8 * kv + 4 * a, mlp_fp32
    elif half and setup.fsdp_mixed_precision:
        # FSDP2's MixedPrecisionPolicy: the layer's inputs arrive in 16 bits, so the linears' inputs need no
        # cast of their own (the norms still compute, and save, in fp32)
        replicated = 16 * h + 8
        sharded, mlp = 4 * h + 4 * kv + 4 * a, mlp_half
    elif half:
        replicated = 16 * h + 8 + 10 * h
        sharded, mlp = 4 * h + 4 * kv + 4 * a, mlp_half
    else:  # weights kept in 16-bit: everything 16-bit, no separate casts
        replicated = 12 * h + 8
        sharded, mlp = 4 * h + 4 * kv + 4 * a, mlp_half
    if shape.qk_norm:  # Qwen3's per-head RMSNorm of q and k computes in fp32: its input and normalised output are
        # kept in fp32 (and, under 16 bits, the cast back)
        sharded += (8 if setup.precision == "fp32" else 10) * (shape.q_size + shape.kv_size)
    if not setup.flash_attention:  # scores, softmax and its mask: 5*a*s bytes per token (16-bit)
        sharded += 5 * a * setup.seq_length // setup.cp
    return replicated, sharded, mlp


def selective_saving(shape: ModelShape, setup: TrainSetup) -> tuple[float, float]:
    """(attention, MLP) bytes per token that selective recompute does not keep (recomputed in backward).

    canntrain's selective recompute keeps every matmul input and output and recomputes the cheap
    element-wise ops: the MLP activation and its product with the up projection, and the attention
    core (scores, when not flash) — the part Korthikanti et al. call selective.
    """
    i = shape.intermediate_size
    if shape.kind == "moe":
        i = i * shape.experts_per_token + shape.shared_expert_size
    width = 4 if setup.precision == "fp32" else 2
    mlp = 2 * width * i if shape.kind != "gpt" else width * i
    attention = 5 * shape.num_heads * setup.seq_length // setup.cp if not setup.flash_attention else 0
    return attention, mlp


def layer_activations(shape: ModelShape, setup: TrainSetup, recompute: str | None = None) -> LayerActivations:
    """Saved bytes of one block for one micro-batch, for the given (or the setup's) recompute level."""
    recompute = recompute or setup.recompute
    tokens = setup.micro_batch * setup.seq_length // setup.cp
    tp = setup.tp
    h = shape.hidden_size
    if recompute == "full":  # only the block input (fp32 residual stream, or 16-bit weights mode)
        width = 2 if setup.weights_16bit else 4
        per_tok = width * h / (tp if setup.sequence_parallel else 1)
        return LayerActivations(int(tokens * per_tok), 0)
    replicated, sharded, mlp = _per_token(shape, setup)
    if recompute == "selective":
        attention_saving, mlp_saving = selective_saving(shape, setup)
        sharded, mlp = sharded - attention_saving, mlp - mlp_saving
    per_tok = replicated / (tp if setup.sequence_parallel else 1) + sharded / tp + mlp / shape.mlp_tp(tp)
    copies = 0
    if setup.precision != "fp32" and not setup.weights_16bit:
        copies = 2 * shape.elements_per_rank(shape.local_matrices(setup.ep), tp)  # a MoE: local experts only
    return LayerActivations(int(tokens * per_tok), copies)


def recompute_transient(shape: ModelShape, setup: TrainSetup) -> int:
    """Bytes a recomputed block needs again during its backward (one block's activations)."""
    if setup.recompute == "none":
        return 0
    full = layer_activations(shape, setup, "none")
    if setup.recompute == "full":
        return full.total
    return full.total - layer_activations(shape, setup, "selective").total


RING_QUERY_TILE = 256  # query rows of a ring-attention block computed at once (parallel/context.py)


def ring_block_transient(shape: ModelShape, setup: TrainSetup, backward: bool = False) -> int:
    """Bytes of one ring-attention tile under context parallel (``parallel/context.py``): fp32 matrices of
    (micro-batch, heads / tp, RING_QUERY_TILE rows or fewer, S / cp keys), alive while the tile is computed: the
    scores and probabilities in forward; in backward, which recomputes them from the saved log-sum-exp, those and
    the gradients of both. Nothing of it is kept between layers."""
    if setup.cp == 1:
        return 0
    keys = setup.seq_length // setup.cp
    rows = min(keys, RING_QUERY_TILE)
    return (4 if backward else 2) * 4 * setup.micro_batch * (shape.num_heads // setup.tp) * rows * keys
