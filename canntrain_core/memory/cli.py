"""`canntrain estimate` and `canntrain plan`: the memory estimator and the parallel-plan search."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from canntrain_core.memory.recipe_shape import shape_from_recipe
from canntrain_core.recipe import load_recipe
from canntrain_core.sizing.devices import DEVICES, get_device, parse_bytes
from canntrain_core.sizing.estimator import GiB, estimate
from canntrain_core.sizing.layout import check_layout
from canntrain_core.sizing.setup import TrainSetup, setup_from_recipe
from canntrain_core.sizing.shapes import shape_from_preset


def register(subparsers) -> None:
    p = subparsers.add_parser("estimate", help="per-rank memory of a recipe, analytic (and measured with --measure)")
    p.add_argument("recipe", help="recipe YAML")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a recipe key, e.g. data.seq_length=4096 (repeatable)",
    )
    p.add_argument("--measure", action="store_true", help="also run one step under FakeTensorMode and compare")
    p.add_argument(
        "--device-memory",
        default=None,
        help="capacity to check against: 64GiB, 80GB or a preset (default: the recipe's distributed.target_device)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object (bytes per category per method)")
    p.set_defaults(func=run_estimate)

    q = subparsers.add_parser("plan", help="search tp x pp x dp x ZeRO x recompute x micro-batch layouts that fit")
    q.add_argument("--model", required=True, help="preset, e.g. llama2-70b (or gpt3-13b, mixtral-8x7b)")
    q.add_argument("--devices", type=int, required=True)
    q.add_argument("--devices-per-node", type=int, default=8)
    q.add_argument("--device", default="910b", help=f"device preset for FLOP/s and links: {', '.join(DEVICES)}")
    q.add_argument("--device-memory", default=None, help="capacity per device (default: the preset's)")
    q.add_argument("--seq-length", type=int, default=4096)
    q.add_argument("--global-batch", type=int, default=1024, help="sequences per optimizer step")
    q.add_argument("--precision", default="bf16", choices=["bf16", "fp16", "fp32"])
    q.add_argument("--offload-optimizer", action="store_true")
    q.add_argument(
        "--replicated-vocab",
        action="store_true",
        help="plan with the embedding and head replicated over TP (distributed.vocab_parallel: false)",
    )
    q.add_argument("--top", type=int, default=10, help="how many fitting plans to print")
    q.add_argument(
        "--show-skipped",
        action="store_true",
        help="also count the layouts the trainer refuses, by reason (they are never ranked)",
    )
    q.add_argument("--json", action="store_true")
    q.set_defaults(func=run_plan)


def run_estimate(args: argparse.Namespace) -> int:
    # deferred: start-up time (canntrain --help loads neither memory.alignment nor memory.report)
    from canntrain_core.memory.alignment import several_models
    from canntrain_core.memory.report import compare_table, estimate_table, to_json

    recipe = load_recipe(args.recipe, args.overrides)
    shape, setup = shape_from_recipe(recipe), setup_from_recipe(recipe)
    check_layout(recipe, shape)  # the estimate of a layout the trainer refuses would mislead
    target = recipe.distributed.target_device
    cap = parse_bytes(args.device_memory or target) if (args.device_memory or target) else None
    if several_models(recipe):  # the alignment stages
        return _estimate_alignment(recipe, cap, args)
    meas = None
    if args.measure:
        # deferred: start-up time (canntrain --help does not load memory.measure)
        from canntrain_core.memory.measure import measure_fake

        # what the measurement harness can build: TP without sequence parallel
        if setup.tp > 1:
            setup = setup.but(sequence_parallel=False)
        try:
            meas = measure_fake(shape, setup)
        except NotImplementedError as e:
            print(f"canntrain estimate: --measure: {e}", file=sys.stderr)
            return 2
    est = estimate(shape, setup)
    if args.json:
        print(json.dumps(to_json(est, meas, cap), indent=2))
        return 0
    print(recipe.summary())
    print(estimate_table(est, cap))
    if meas is not None:
        print()
        print(compare_table(est, meas))
    return 0 if cap is None or est.fits(cap) else 1


def _estimate_alignment(recipe, cap, args) -> int:
    # deferred: start-up time (canntrain --help does not load memory.alignment)
    from canntrain_core.memory.alignment import estimate_alignment

    if args.measure:
        print(
            "canntrain estimate: --measure: not for alignment stages (rlhf_ppo.ipynb measures a real run)",
            file=sys.stderr,
        )
        return 2
    est = estimate_alignment(recipe)
    worst = max(est.trained_rank, est.scorer_rank)
    if args.json:
        print(json.dumps({**asdict(est), "trained_rank": est.trained_rank, "capacity": cap}, indent=2))
    else:
        print(recipe.summary())
        print(est.table())
        if cap:
            print(
                f"{'fits' if worst <= cap else 'does NOT fit'} in {cap / GiB:.1f} GiB ({worst / cap:.0%} used "
                "on the fullest rank)"
            )
    return 0 if cap is None or worst <= cap else 1


def run_plan(args: argparse.Namespace) -> int:
    # deferred: start-up time (canntrain --help does not load sizing.plan)
    from canntrain_core.sizing.plan import guidance_note, search, suggest_when_nothing_fits

    dev = get_device(args.device)
    cap = parse_bytes(args.device_memory) if args.device_memory else dev.memory_bytes
    shape = shape_from_preset(args.model)
    base = TrainSetup(
        precision=args.precision,
        seq_length=args.seq_length,
        offload_optimizer=args.offload_optimizer,
        vocab_parallel=not args.replicated_vocab,
    )
    skipped: dict[str, int] = {}
    plans = search(
        shape, args.devices, dev, args.devices_per_node, args.global_batch, base, memory_bytes=cap, skipped=skipped
    )
    fitting = [p for p in plans if p.fits]
    suggestions = (
        []
        if fitting
        else suggest_when_nothing_fits(shape, args.devices, dev, args.devices_per_node, args.global_batch, base, cap)
    )
    if args.json:
        print(
            json.dumps(
                {
                    "model": args.model,
                    "devices": args.devices,
                    "capacity": int(cap),
                    "plans": [p.to_dict() for p in fitting],
                    "infeasible": [p.to_dict() for p in plans if not p.fits],
                    "refused": skipped,
                    "suggestions": suggestions,
                },
                indent=2,
            )
        )
        return 0 if fitting else 1
    print(
        f"{args.model}: {shape.num_params() / 1e9:.1f} B params on {args.devices} x {cap / GiB:.0f} GiB "
        f"({dev.name}), seq {args.seq_length}, global batch {args.global_batch}"
    )
    print(
        f"{len(plans)} layouts the trainer accepts, {len(fitting)} fit"
        + ("" if args.show_skipped or not skipped else " (others refused by the layout validator: --show-skipped)")
    )
    if args.show_skipped:
        print("refused by the layout validator (count: reason):")
        for why, n in sorted(skipped.items(), key=lambda kv: -kv[1]):
            print(f"  {n:5d}: {why}")
    if not fitting:
        print("nothing fits:")
        for line in suggestions:
            print("  - " + line)
        return 1
    print(f"{'plan':34s} {'GiB':>6s} {'step s':>8s}  notes")
    for p in fitting[: args.top]:
        print(f"{p.label():34s} {p.estimate.total / GiB:6.1f} {p.step_time:8.1f}  {'; '.join(p.remarks)}")
    print("best vs guidance: " + guidance_note(fitting[0], args.devices_per_node))
    return 0
