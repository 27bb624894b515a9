"""Parallel-plan search: every tp x pp x dp (x cp, x ep) x ZeRO x recompute x micro-batch layout
of a device count that the trainer accepts (``sizing/layout.py``), filtered by the memory estimate
and ranked by a simple step-time model.

Cost model (per optimizer step, seconds; nothing overlaps, so it is a pessimistic, comparable figure):

* compute  = FLOPs / (devices x peak x efficiency), FLOPs = ``ModelShape.flops_per_token`` x tokens
  (the definition MFU uses), x 4/3 for full recompute (one more forward), x 7/6 for selective (half
  the layers);
* traffic  = ``sizing/comm.py``'s bytes per device per step (the definition the overhead benchmark
  checks on the wire) over the intra-node link when the group fits in one node, the inter-node link
  otherwise; cp adds a ring pass of k and v per layer and micro-batch; ep its all-to-alls of routed tokens;
* bubble   = (compute + tp/cp) scaled by (pp - 1) / m: the pipeline's idle share with m micro-batches.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable

from canntrain_core.sizing.comm import comm_per_step
from canntrain_core.sizing.devices import DeviceSpec
from canntrain_core.sizing.estimator import GiB, MemoryEstimate, estimate
from canntrain_core.sizing.layout import Layout, context_parallel_pays, layout_problems
from canntrain_core.sizing.setup import RECOMPUTE_LEVELS, TrainSetup
from canntrain_core.sizing.shapes import ModelShape

EFFICIENCY = 0.5  # achieved share of peak FLOP/s in matmuls; a parameter of the cost model


@dataclass
class Plan:
    setup: TrainSetup
    estimate: MemoryEstimate | None
    fits: bool
    reason: str = ""
    step_time: float = math.inf
    breakdown: dict[str, float] = field(default_factory=dict)
    remarks: list[str] = field(default_factory=list)

    def label(self) -> str:
        s = self.setup
        extra = (f" cp{s.cp}" if s.cp > 1 else "") + (f" ep{s.ep}" if s.ep > 1 else "")
        return f"tp{s.tp} pp{s.pp} dp{s.dp}{extra} zero{s.zero} {s.recompute} mb{s.micro_batch}"

    def to_dict(self) -> dict[str, Any]:
        s = self.setup
        return {
            "tp": s.tp,
            "pp": s.pp,
            "dp": s.dp,
            "cp": s.cp,
            "ep": s.ep,
            "zero": s.zero,
            "recompute": s.recompute,
            "micro_batch": s.micro_batch,
            "grad_accum": s.grad_accum,
            "offload_optimizer": s.offload_optimizer,
            "fits": self.fits,
            "reason": self.reason,
            "memory_bytes": self.estimate.total if self.estimate else None,
            "step_time_s": None if math.isinf(self.step_time) else self.step_time,
            "breakdown_s": self.breakdown,
            "remarks": self.remarks,
        }


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def step_time(
    shape: ModelShape,
    s: TrainSetup,
    dev: DeviceSpec,
    devices_per_node: int,
    global_batch: int,
    efficiency: float = EFFICIENCY,
) -> dict[str, float]:
    """Seconds per optimizer step by component (see the module docstring)."""
    n_dev = s.world_size
    tokens = global_batch * s.seq_length
    flops = shape.flops_per_token(s.seq_length) * tokens
    flops *= {"full": 4 / 3, "selective": 7 / 6}.get(s.recompute, 1.0)  # forward (1/3) again, all or half the layers
    compute = flops / (n_dev * dev.peak_flops * efficiency)
    m = s.microbatches

    def bw(group_span: int) -> float:
        return dev.intra_node_bw if group_span <= devices_per_node else dev.inter_node_bw

    rows = comm_per_step(
        shape,
        Layout.from_setup(s),
        s.micro_batch,
        s.seq_length // s.cp,
        m,
        s.zero,
        s.precision,
        sequence_parallel=s.sequence_parallel,
        vocab_parallel=s.vocab_parallel,
    )
    traffic = {
        k: sum(r["bytes"] for r in rows if r["strategy"] in names)
        for k, names in (("tp", ("TP", "TP+SP")), ("dp", ("DP", "FSDP")), ("pp", ("PP",)), ("ep", ("EP",)))
    }
    tp_comm = traffic["tp"] / bw(s.tp)
    cp_comm = 0.0
    if s.cp > 1:
        kv = 2 * 2 * s.micro_batch * s.seq_length // s.cp * shape.kv_size // s.tp
        cp_comm = math.ceil(shape.num_layers / s.pp) * m * 3 * (s.cp - 1) * kv / bw(s.tp * s.cp)
    dp_comm = traffic["dp"] / bw(s.tp * s.cp * s.dp)
    pp_comm = traffic["pp"] / bw(s.tp * s.cp * s.dp * 2)
    ep_comm = traffic["ep"] / bw(s.tp * s.cp * s.ep)  # ep: consecutive data-parallel ranks
    busy = compute + tp_comm + cp_comm + ep_comm  # a token waits for its experts' exchange
    bubble = busy * (s.pp - 1) / m if s.pp > 1 else 0.0
    return {
        "compute": compute,
        "tp_cp_comm": tp_comm + cp_comm,
        "ep_comm": ep_comm,
        "dp_comm": dp_comm,
        "pp_comm": pp_comm,
        "bubble": bubble,
    }


def candidate_setups(
    shape: ModelShape,
    devices: int,
    devices_per_node: int,
    global_batch: int,
    base: TrainSetup,
    micro_batches: Iterable[int] = (1, 2, 4, 8),
) -> Iterable[tuple[TrainSetup, list[str]]]:
    """Every layout of ``devices``, with the validator's reasons when the trainer would refuse it.

    Sequence parallel is on wherever the trainer can run it (tp > 1 without pp): it only saves
    memory; the embedding, head and loss are split over the vocabulary under TP as ``base`` says (the
    trainer's default, ``distributed.vocab_parallel: true``).
    """
    cps = [c for c in (1, 2, 4, 8) if devices % c == 0 and context_parallel_pays(base.seq_length, c)]
    for tp in _divisors(devices):
        for pp in _divisors(devices // tp):
            for cp in cps:
                if devices % (tp * pp * cp):
                    continue
                dp = devices // (tp * pp * cp)
                for ep in [e for e in _divisors(dp * cp) if shape.num_experts % e == 0] if shape.kind == "moe" else [1]:
                    for zero in (0, 1, 2, 3) if dp * cp > 1 else (0,):
                        for rc in RECOMPUTE_LEVELS:
                            for mb in micro_batches:
                                if global_batch % (dp * mb):
                                    continue
                                setup = base.but(
                                    tp=tp,
                                    pp=pp,
                                    dp=dp,
                                    cp=cp,
                                    ep=ep,
                                    zero=zero,
                                    recompute=rc,
                                    micro_batch=mb,
                                    grad_accum=global_batch // (dp * mb),
                                    num_microbatches=None,
                                    vocab_parallel=base.vocab_parallel,
                                    sequence_parallel=tp > 1 and pp == 1,
                                )
                                yield setup, layout_problems(Layout.from_setup(setup), shape, devices_per_node)


def search(
    shape: ModelShape,
    devices: int,
    dev: DeviceSpec,
    devices_per_node: int = 8,
    global_batch: int = 1024,
    base: TrainSetup | None = None,
    efficiency: float = EFFICIENCY,
    memory_bytes: float | None = None,
    skipped: dict[str, int] | None = None,
) -> list[Plan]:
    """Every layout the trainer accepts: fitting ones ranked fastest first, then those that do not fit.

    Layouts the validator (``sizing.layout``) refuses are not plans; ``skipped``, when given, counts
    them by reason.
    """
    base = base or TrainSetup()
    cap = memory_bytes or dev.memory_bytes
    plans: list[Plan] = []
    for setup, problems in candidate_setups(shape, devices, devices_per_node, global_batch, base):
        if problems:
            if skipped is not None:
                for why in problems:
                    skipped[why] = skipped.get(why, 0) + 1
            continue
        est = estimate(shape, setup)
        if not est.fits(cap):
            big = max(est.categories, key=est.categories.get)
            plans.append(
                Plan(
                    setup,
                    est,
                    False,
                    f"needs {est.total / GiB:.1f} GiB > {cap / GiB:.1f} GiB "
                    f"(model states {est.model_states / GiB:.1f} GiB, largest: {big})",
                )
            )
            continue
        parts = step_time(shape, setup, dev, devices_per_node, global_batch, efficiency)
        plans.append(Plan(setup, est, True, "", sum(parts.values()), parts, _remarks(setup, parts, devices_per_node)))
    plans.sort(key=lambda p: (not p.fits, p.step_time))
    return plans


def _remarks(s: TrainSetup, parts: dict[str, float], devices_per_node: int) -> list[str]:
    out = []
    total = sum(parts.values())
    if s.pp > 1:
        out.append(f"pipeline bubble {parts['bubble'] / total:.0%} of the step (m={s.microbatches}, pp={s.pp})")
    if parts["dp_comm"] / total > 0.2:
        out.append(f"gradient traffic {parts['dp_comm'] / total:.0%} of the step")
    if parts["ep_comm"] / total > 0.2:
        out.append(f"expert all-to-all {parts['ep_comm'] / total:.0%} of the step")
    if s.pp > 8:
        out.append("pp > 8: outside the usual 4-8 range")
    return out


def guidance_note(best: Plan, devices_per_node: int) -> str:
    """How the best plan compares with the rule of thumb: TP within a node, PP 4-8, the rest to DP."""
    s = best.setup
    bits = []
    bits.append("TP within a node")  # the validator refuses TP across nodes
    if 4 <= s.pp <= 8:
        bits.append("PP in 4-8")
    elif s.pp < 4:
        bits.append(
            f"PP={s.pp} (< 4: the cost model prefers fewer stages here since memory allows it; "
            f"each stage adds bubble {s.pp - 1}/(m+{s.pp - 1}))"
        )
    else:
        bits.append(f"PP={s.pp} (> 8)")
    bits.append(f"DP={s.dp} takes the rest")
    return "; ".join(bits)


def suggest_when_nothing_fits(
    shape: ModelShape,
    devices: int,
    dev: DeviceSpec,
    devices_per_node: int,
    global_batch: int,
    base: TrainSetup,
    memory_bytes: float | None = None,
) -> list[str]:
    """What would make a plan exist: more devices, optimizer offload (recompute is already searched)."""
    cap = memory_bytes or dev.memory_bytes
    half = base.weights == "half" or base.precision == "fp32"
    per_param = 16 if not base.offload_optimizer else (4 if half else 8)
    floor = per_param * shape.num_params() / devices
    out = [
        f"model states alone need at least {per_param} B x {shape.num_params() / 1e9:.1f} B params / "
        f"{devices} devices = {floor / GiB:.1f} GiB per device, however the work is split "
        f"(device has {cap / GiB:.1f} GiB); full recompute is already among the candidates"
    ]
    for more in (2 * devices, 4 * devices):
        ok = [p for p in search(shape, more, dev, devices_per_node, global_batch, base, memory_bytes=cap) if p.fits]
        if ok:
            out.append(f"with {more} devices {len(ok)} plans fit, fastest: {ok[0].label()}")
            break
    if not base.offload_optimizer:
        ok = [
            p
            for p in search(
                shape, devices, dev, devices_per_node, global_batch, base.but(offload_optimizer=True), memory_bytes=cap
            )
            if p.fits
        ]
        if ok:
            host = ok[0].estimate.host_bytes / GiB if ok[0].estimate else 0
            out.append(
                f"with optimizer offload (optim.offload_optimizer: true) {len(ok)} plans fit, fastest: "
                f"{ok[0].label()} ({host:.0f} GiB host memory per device)"
            )
        else:
            out.append("optimizer offload alone is not enough")
    return out
