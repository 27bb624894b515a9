"""The analytic per-rank memory estimate: parameters, gradients, optimizer states, activations, ...

How the peak is found: memory during one optimizer step is a few straight lines. It is largest
either when the last forward ends (all activations alive, loss buffers at their peak), at the end of
backward (all gradients written, the other in-flight micro-batches still alive), or in the optimizer
step (gradients + states + the update's temporaries). :func:`estimate` evaluates all three and
reports the categories at the largest. Pipeline ranks differ (the first stage holds the embedding
and the most in-flight micro-batches, the last one the logits); the worst stage is reported.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from canntrain_core.sizing.activations import layer_activations, recompute_transient, ring_block_transient
from canntrain_core.sizing.setup import TrainSetup, nf4_bytes
from canntrain_core.sizing.shapes import ROUTED_EXPERT, ModelShape

GiB = 1024**3
GB = 1000**3

# Categories, in the order tables show them.
CATEGORIES = (
    "parameters",
    "gradients",
    "optimizer_states",
    "optimizer_step_temporaries",
    "activations",
    "autocast_weight_copies",
    "logits_loss",
    "communication_buffers",
    "fragmentation",
)
MODEL_STATES = ("parameters", "gradients", "optimizer_states")
# Allocator slack on top of what tensors use (caching allocator block rounding and splitting);
# an explicit, documented allowance instead of a hidden fudge factor. Not part of fake-mode peaks.
FRAGMENTATION = 0.05
DDP_BUCKET_BYTES = 25 * 2**20  # torch DDP default bucket_cap_mb


@dataclass
class MemoryEstimate:
    """Per-rank bytes by category at the peak, plus host memory for offloaded optimizer states."""

    categories: dict[str, int]
    phase: str  # where the peak is: "forward", "backward_start", "backward_end" or "optimizer_step"
    stage: str  # "only", "first" or "last" pipeline stage
    host_bytes: int = 0
    notes: list[str] = field(default_factory=list)
    params_per_rank: int = 0
    phases: dict[str, int] = field(default_factory=dict)
    states: dict[str, int] = field(default_factory=dict)  # params, all grads, optimizer states (device)

    @property
    def total(self) -> int:
        return sum(self.categories.values())

    @property
    def tracked_total(self) -> int:
        """Total without the fragmentation allowance (what a tensor-level tracker can see)."""
        return self.total - self.categories["fragmentation"]

    @property
    def model_states(self) -> int:
        """Parameters + all gradients + device optimizer states (whatever phase the peak is in)."""
        return sum(self.states.values())

    def fits(self, capacity_bytes: float) -> bool:
        return self.total <= capacity_bytes

    def to_dict(self) -> dict[str, Any]:
        return {
            "categories": dict(self.categories),
            "total": self.total,
            "phase": self.phase,
            "stage": self.stage,
            "host_bytes": self.host_bytes,
            "notes": list(self.notes),
        }


@dataclass(frozen=True)
class _Stage:
    name: str
    layers: int
    embedding: bool
    head: bool
    inflight: int  # micro-batches whose activations are alive at the end of the last forward


def _stages(shape: ModelShape, s: TrainSetup) -> list[_Stage]:
    per = math.ceil(shape.num_layers / s.pp)
    if s.pp == 1:
        return [_Stage("only", shape.num_layers, True, True, 1)]
    m = s.microbatches
    first_inflight = m if s.pipeline_schedule == "gpipe" else min(s.pp, m)
    return [
        _Stage("first", per, True, False, first_inflight),
        _Stage("last", shape.num_layers - per * (s.pp - 1), False, True, 1 if s.pipeline_schedule == "1f1b" else m),
    ]


def _trainable(shape: ModelShape, s: TrainSetup, matrices: list[tuple[str, int, int]]) -> list[int]:
    """Per-rank element counts of the trainable tensors of one block, in registration order."""
    if s.lora is not None:
        return [s.lora.rank * (o + i) // s.tp for name, o, i in matrices if name in s.lora.targets]
    return [shape.elements_per_rank([m], s.tp) for m in matrices] + [_vectors_per_rank(shape, s.tp)]


def _row_padding(matrices: list[tuple[str, int, int]], shard: int) -> int:
    """Elements (over all ``shard`` ranks) that FSDP2 adds to a block by padding each matrix's rows to a multiple
    of ``shard``."""
    return sum((-(-o // shard) * shard - o) * i for _, o, i in matrices if o % shard)


def _vectors_per_rank(shape: ModelShape, tp: int) -> int:
    whole, split = shape.layer_vectors_split()
    return whole + split // tp


def estimate(shape: ModelShape, s: TrainSetup, fragmentation: float = FRAGMENTATION) -> MemoryEstimate:
    """Per-rank memory of training ``shape`` as laid out by ``s``; the worst pipeline stage."""
    best: MemoryEstimate | None = None
    for stage in _stages(shape, s):
        est = _estimate_stage(shape, s, stage, fragmentation)
        if best is None or est.total > best.total:
            best = est
    assert best is not None
    return best


def _estimate_stage(shape: ModelShape, s: TrainSetup, st: _Stage, frag: float) -> MemoryEstimate:
    notes: list[str] = []
    tp, h, V = s.tp, shape.hidden_size, shape.out_rows  # V: rows of the output projection and the logits
    shard = s.dp * s.cp  # ZeRO/FSDP shards over data (and context) parallel ranks
    at_rest = shape.layer_matrices()
    matrices = shape.local_matrices(s.ep)  # a rank gathers and computes with its ep share of the experts
    routed = [m for m in matrices if m[0] in ROUTED_EXPERT] if shape.kind == "moe" else []
    local_experts = shape.elements_per_rank(routed, tp)
    # ---- element counts per rank, before ZeRO
    layer_elems = shape.elements_per_rank(matrices, tp) + _vectors_per_rank(shape, tp)
    vtp = tp if s.vocab_parallel else 1
    tokens = shape.vocab_size * h  # the embedding's rows split over the vocabulary; GPT-2's positions whole
    emb = shape.embedding_params() - tokens + tokens // vtp if st.embedding else 0
    head = 0
    if st.head:
        head = (
            shape.head_params() - (0 if shape.tie_embeddings else V * h) + (0 if shape.tie_embeddings else V * h // vtp)
        )
    elems = st.layers * layer_elems + emb + head
    # FSDP2 shards a rank's experts over dp*cp/ep ranks only: at rest it holds 1/(dp*cp) of all of them, as
    # without EP; what EP saves is the gathered layer (and, without FSDP, the experts at rest)
    elems_at_rest = elems + (st.layers * local_experts * (s.ep - 1) if s.fsdp else 0)
    train_layer = _trainable(shape, s, at_rest if s.fsdp else matrices)
    if s.lora is None:
        trainable = elems_at_rest
        out_proj = 0 if shape.tie_embeddings else V * h // vtp
        tensors = ([emb] if emb else []) + train_layer * st.layers + ([head - out_proj, out_proj] if head else [])
    else:
        trainable = st.layers * sum(train_layer)
        tensors = train_layer * st.layers
        notes.append(f"LoRA rank {s.lora.rank} on {', '.join(s.lora.targets)}: {trainable:,} trainable per rank")
    # ---- bytes per element
    half_w = s.precision != "fp32" and s.weights == "half"
    p_b, g_b = (2, 2) if half_w else (4, 4)
    o_b = 12 if half_w else 8  # (fp32 master +) AdamW m and v
    # FSDP2 (parallel/data_parallel.py): fp32 masters sharded at rest; compute copies gathered in
    # 16 bits (MixedPrecisionPolicy) or fp32, kept from forward to backward by ZeRO-1/2 and pipelines;
    # gradients reduce-scattered after each micro-batch, except that ZeRO-1 under accumulation and
    # pipeline schedules accumulate them unsharded (fp32) until the step's last micro-batch.
    fsdp, mp = s.fsdp, s.fsdp_mixed_precision
    c_b = 2 if mp else p_b  # bytes of a gathered parameter
    keeps_gathered = fsdp and (s.zero < 3 or s.pp > 1)
    full_grads = fsdp and (s.pp > 1 or (s.zero == 1 and s.microbatches > 1))
    div_p = shard if fsdp else 1
    div_g = shard if fsdp and not full_grads else 1
    div_o = shard if s.zero >= 1 else 1
    # FSDP2 pads a tensor's rows to a multiple of the shards: a one-row gate (Qwen2-MoE's shared expert's) or 60
    # experts' router rows over 32 ranks cost every rank a whole shard of rows
    pad = st.layers * _row_padding(at_rest, shard) if fsdp and s.lora is None else 0
    elems_at_rest += pad
    trainable += pad
    if s.lora is None:
        params = p_b * elems_at_rest // div_p
    elif s.lora.base_bits == 4:  # QLoRA: the block linears in NF4 (models.quantize), the rest 16-bit; one device
        linear = st.layers * shape.elements_per_rank(matrices, tp)
        params = 2 * (elems_at_rest - linear) + nf4_bytes(linear) + 4 * trainable
    else:  # the frozen base in 16 bits under bf16/fp16 (else fp32), the adapters in fp32
        params = ((2 if s.weights_16bit else p_b) * elems_at_rest + 4 * trainable) // div_p
    gathered = c_b * elems if keeps_gathered else 0  # only between forward and the last backward
    grads = g_b * trainable // div_g
    opt = o_b * trainable // div_o
    # step temporaries: foreach=False keeps the previous tensor's denominator while computing the next
    # one (sqrt, then division): max over neighbours of prev + 2*cur, fp32; foreach=True: one fp32 list.
    shards = [t // div_o for t in tensors]
    if s.optimizer_foreach:
        temps = 4 * sum(shards)
    else:
        temps = 4 * max((2 * c + (shards[k - 1] if k else 0) for k, c in enumerate(shards)), default=0)
    host = 0
    if s.offload_optimizer:  # CPUOffloadPolicy: sharded params, grads and optimizer states on the host
        host = params + g_b * trainable // shard + opt + temps
        notes.append(
            f"FSDP2 CPU offload: {host / GiB:.1f} GiB of host memory per rank (sharded parameters, "
            "gradients, optimizer states; the optimizer step runs there)"
        )
        params = opt = temps = 0
        grads = grads if full_grads else 0  # an unsharded accumulation stays on the device until reduced
    # ---- activations of one micro-batch on this stage
    la = layer_activations(shape, s)
    tokens = s.micro_batch * s.seq_length // s.cp
    acts_mb = st.layers * la.tensors
    copies_mb = st.layers * la.weight_copies
    if s.lora is not None and s.precision != "fp32":
        copies_mb += 2 * trainable  # autocast's 16-bit copies of the fp32 adapters (the base is 16-bit already)
    sp = tp if s.sequence_parallel else 1
    if st.embedding:
        acts_mb += 8 * tokens + 8 * s.seq_length // s.cp * shape.head_dim  # ids, rope cos/sin
    if st.head:
        acts_mb += int(tokens * (8 * h + 4) / sp)  # final norm: x, n
    # logits: 16-bit logits, fp32 copy and log_softmax output coexist in forward; fp32 kept for backward,
    # its gradient and the gradient w.r.t. the 16-bit logits in backward.
    logits_saved = logits_peak = 0
    if st.head:
        vloc = V // vtp
        amp = s.precision != "fp32" and not s.weights_16bit
        logits_saved = 4 * tokens * vloc + (2 * tokens * h // sp if amp else 0)
        logits_peak = logits_saved + 8 * tokens * vloc  # backward: grad of log_softmax out and of its input
        if amp:
            copies_mb += 2 * V * h // vtp
    if mp:  # FSDP2 gathers 16-bit weights: autocast has nothing to copy
        copies_mb = 0
    recomp = recompute_transient(shape, s)
    # context parallel: one attention block's scores at a time (forward; recomputed with their gradients in backward)
    ring, ring_bw = ring_block_transient(shape, s), ring_block_transient(shape, s, backward=True)
    # ---- communication buffers
    comm = 0
    if s.zero >= 3 and shard > 1 and not keeps_gathered:
        comm += 2 * c_b * layer_elems  # current + prefetched unsharded block
        notes.append("ZeRO-3/FSDP: two unsharded blocks (current + prefetch) counted as communication buffers")
    elif shard > 1 and s.zero < 2:
        comm += 2 * DDP_BUCKET_BYTES
    if tp > 1 and s.sequence_parallel:
        comm += 2 * tokens * h  # all-gathered 16-bit block input
    # FSDP2's reduce-scatter in backward: a block's unsharded gradients in the compute dtype and, under its
    # MixedPrecisionPolicy, their fp32 copy for the reduction (measured in fake mode: 1.4 GiB for a 7B block)
    reduce = layer_elems * (c_b + 4 if mp else 4) if fsdp and shard > 1 and not full_grads else 0
    # ---- grads alive during forward (accumulation, pipelining)
    g_fw = grads if s.microbatches > 1 else 0
    base = params + opt + comm
    inflight = st.inflight
    act_all = inflight * acts_mb
    cop_all = inflight * copies_mb
    emb_grad = g_b * (shape.embedding_params() // vtp) // div_g if (st.embedding and s.lora is None) else 0
    phases = {
        "forward": base + gathered + g_fw + act_all + cop_all + max(logits_peak, ring),
        "backward_start": base + gathered + g_fw + act_all + cop_all + logits_saved + recomp + ring_bw,
        "backward_end": base
        + gathered
        + grads
        - emb_grad
        + (inflight - 1) * (acts_mb + copies_mb)
        + recomp
        + ring_bw
        + reduce,
        "optimizer_step": base + grads + temps,
    }
    phase = max(phases, key=phases.get)
    cats = dict.fromkeys(CATEGORIES, 0)
    cats.update(
        parameters=params + (gathered if phase != "optimizer_step" else 0),
        optimizer_states=opt,
        communication_buffers=comm,
    )
    if phase == "forward":
        cats.update(
            gradients=g_fw,
            activations=act_all + max(0, ring - logits_peak),
            autocast_weight_copies=cop_all,
            logits_loss=logits_peak,
        )
    elif phase == "backward_start":
        cats.update(
            gradients=g_fw,
            activations=act_all + recomp + ring_bw,
            autocast_weight_copies=cop_all,
            logits_loss=logits_saved,
        )
    elif phase == "backward_end":
        cats.update(
            communication_buffers=comm + reduce,
            gradients=grads - emb_grad,
            activations=(inflight - 1) * acts_mb + recomp + ring_bw,
            autocast_weight_copies=(inflight - 1) * copies_mb,
        )
    else:
        cats.update(gradients=grads, optimizer_step_temporaries=temps)
    cats["fragmentation"] = int(frag * sum(cats.values()))
    if mp:
        notes.append(
            "FSDP2 mixed precision: sharded fp32 masters (4 B) + grads (4 B) + AdamW m, v (8 B) = 16 B "
            "per parameter / shards, plus bf16 copies of what is gathered"
        )
    elif s.lora is not None and s.precision != "fp32":
        base = "block linears in 4-bit NF4 (0.52 B per weight), the rest" if s.lora.base_bits == 4 else "base"
        notes.append(
            f"LoRA: the frozen {base} in {s.precision} (2 B per parameter, no autocast copy); the adapters fp32 with "
            "fp32 grads and AdamW m, v (16 B per adapter parameter)"
        )
    elif not half_w and s.precision != "fp32":
        notes.append("amp: fp32 weights (4 B) + fp32 grads (4 B) + AdamW m, v (8 B) = 16 B per parameter")
    states = {"parameters": params, "gradients": grads, "optimizer_states": opt}
    return MemoryEstimate(cats, phase, st.name, host, notes, elems, phases, states)
