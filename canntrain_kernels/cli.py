"""``canntrain kernels check``: numerics and speed of every available kernel backend here."""

from __future__ import annotations

import argparse
import json
import sys

from canntrain_kernels import registry
from canntrain_kernels.cases import SHAPES
from canntrain_kernels.check import failed, format_table, run_check


def _csv(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def register(subparsers) -> None:
    """Add ``kernels`` (with its ``check`` subcommand) to the canntrain command line."""
    p = subparsers.add_parser("kernels", help="fused kernels: check numerics and speed per backend")
    sub = p.add_subparsers(dest="kernels_command", required=True)
    c = sub.add_parser(
        "check",
        help="compare each backend with an fp64 reference (forward and backward) and time it",
        description="Exit status 1 if any available backend is outside its dtype's tolerance.",
    )
    c.add_argument("--ops", type=_csv, default=list(registry.OPS), help=f"comma list of {','.join(registry.OPS)}")
    c.add_argument(
        "--backends", type=_csv, default=list(registry.BACKENDS), help=f"comma list of {','.join(registry.BACKENDS)}"
    )
    c.add_argument("--dtypes", type=_csv, default=["fp32", "bf16"], help="comma list of fp32,bf16,fp16")
    c.add_argument(
        "--shapes",
        type=_csv,
        default=["small"],
        help=f"comma list of {','.join(SHAPES)}; change a field with name:key=value, e.g. small:seq=100",
    )
    c.add_argument("--device", default=None, help="cpu, cuda or npu (default: the accelerator here)")
    c.add_argument("--repeat", type=int, default=5, help="timed runs per measurement (median is reported)")
    c.add_argument("--warmup", type=int, default=2, help="untimed runs before timing")
    c.add_argument("--no-timing", action="store_true", help="numerics only")
    c.add_argument("--json", action="store_true", help="print one JSON record per line instead of a table")
    c.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        records = run_check(
            ops=args.ops,
            backends=args.backends,
            dtypes=args.dtypes,
            shapes=args.shapes,
            device=args.device,
            timing=not args.no_timing,
            warmup=args.warmup,
            repeat=args.repeat,
        )
    except ValueError as e:
        print(f"canntrain kernels check: {e}", file=sys.stderr)
        return 2
    if args.json:
        for r in records:
            print(json.dumps(r.to_dict()))
    else:
        print(format_table(records))
    bad = failed(records)
    if bad:
        names = ", ".join(f"{r.op}/{r.backend}/{r.dtype}/{r.shape}" for r in bad)
        print(f"canntrain kernels check: {len(bad)} failed: {names}", file=sys.stderr)
        return 1
    return 0
