"""Analytic memory estimate vs FakeTensorMode + MemTracker measurement, as a markdown table.

    .venv/bin/python benchmarks/memory_fake_vs_analytic.py            # all configurations (~2 min)
    .venv/bin/python benchmarks/memory_fake_vs_analytic.py --quick    # the 2-layer slices only

Each row is one real training step (second of two) of transformers' Llama with canntrain's loss,
run on fake tensors; sharded rows run on a fake process group of dp x tp ranks. Errors are
(analytic - measured) / measured. Also prints the LLaMA-2 70B TP8xPP2 vs TP4xPP4 comparison.
"""

from __future__ import annotations

import argparse
import sys

from canntrain_core.memory import GiB, TrainSetup, estimate, shape_from_preset
from canntrain_core.memory.measure import measure_fake

QUICK = [
    ("tiny fp32 b2 s128", "tiny", None, dict(micro_batch=2, seq_length=128, precision="fp32")),
    ("tiny bf16 b2 s128", "tiny", None, dict(micro_batch=2, seq_length=128)),
    ("7b 2L bf16 b1 s4096", "llama2-7b", 2, dict(micro_batch=1, seq_length=4096)),
    ("7b 2L bf16 b2 s4096 full-recompute", "llama2-7b", 2, dict(micro_batch=2, seq_length=4096, recompute="full")),
    ("7b 2L bf16 FSDP dp8", "llama2-7b", 2, dict(micro_batch=1, seq_length=4096, dp=8, zero=3)),
    (
        "7b 2L bf16 TP2 (no SP)",
        "llama2-7b",
        2,
        dict(micro_batch=1, seq_length=4096, tp=2, sequence_parallel=False, vocab_parallel=False),
    ),
    ("70b 2L bf16 b1 s4096", "llama2-70b", 2, dict(micro_batch=1, seq_length=4096)),
]
FULL = [
    ("7b full bf16 b1 s4096", "llama2-7b", None, dict(micro_batch=1, seq_length=4096)),
    ("7b full bf16 b1 s4096 full-recompute", "llama2-7b", None, dict(micro_batch=1, seq_length=4096, recompute="full")),
    (
        "7b full bf16 FSDP dp8 TP2 (no SP)",
        "llama2-7b",
        None,
        dict(micro_batch=1, seq_length=4096, dp=8, tp=2, zero=3, sequence_parallel=False, vocab_parallel=False),
    ),
    ("70b full bf16 FSDP dp16", "llama2-70b", None, dict(micro_batch=1, seq_length=4096, dp=16, zero=3)),
]


def _err(a: float, m: float) -> str:
    return f"{(a - m) / m:+.1%}" if m > 2**20 else "–"


def table(cases) -> None:
    print(
        "| configuration | model states GiB (analytic / measured, err) | activations at peak err "
        "| peak GiB (analytic / measured, err) | analytic phase | fake-mode s |"
    )
    print("|---|---|---|---|---|---|")
    for name, preset, layers, kw in cases:
        shape = shape_from_preset(preset, {"num_hidden_layers": layers} if layers else None)
        s = TrainSetup(**kw)
        est, meas = estimate(shape, s), measure_fake(shape, s)
        act_a = sum(
            est.categories[c] for c in ("activations", "autocast_weight_copies", "logits_loss", "communication_buffers")
        )
        print(
            f"| {name} | {est.model_states / GiB:.2f} / {meas.model_states / GiB:.2f} "
            f"({_err(est.model_states, meas.model_states)}) | {_err(act_a, meas.categories['activations'])} "
            f"| {est.tracked_total / GiB:.2f} / {meas.peak / GiB:.2f} ({_err(est.tracked_total, meas.peak)}) "
            f"| {est.phase} | {meas.seconds:.1f} |",
            flush=True,
        )


def layouts_70b() -> None:
    shape = shape_from_preset("llama2-70b")
    print(
        "\nLLaMA-2 70B, bf16 amp + AdamW, seq 4096, micro-batch 1, 8 micro-batches, 1F1B, no ZeRO, sequence parallel:"
    )
    print(
        "| layout | recompute | params | grads | optimizer | model states | activations+copies+logits | "
        "total (worst stage) | stage |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for tp, pp in ((8, 2), (4, 4)):
        for rc in ("none", "selective", "full"):
            e = estimate(
                shape,
                TrainSetup(
                    micro_batch=1, seq_length=4096, tp=tp, pp=pp, grad_accum=8, recompute=rc, sequence_parallel=True
                ),
            )
            act = sum(e.categories[c] for c in ("activations", "autocast_weight_copies", "logits_loss"))
            st = e.states
            print(
                f"| TP{tp}xPP{pp} | {rc} | {st['parameters'] / GiB:.1f} | {st['gradients'] / GiB:.1f} | "
                f"{st['optimizer_states'] / GiB:.1f} | {e.model_states / GiB:.1f} | {act / GiB:.1f} | "
                f"{e.total / GiB:.1f} | {e.stage} |"
            )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", default=None, help="rows whose name contains this text")
    args = ap.parse_args(argv)
    cases = QUICK if args.quick else QUICK + FULL
    table([c for c in cases if args.only is None or args.only in c[0]])
    layouts_70b()
    return 0


if __name__ == "__main__":
    sys.exit(main())
