"""`canntrain plot RUN_DIR [RUN_DIR ...] [--keys loss,lr,...] [--labels a,b] [--out FILE.png]`: the logged curves of
one or more runs overlaid, one panel per metric (the cann-recipes-train articles' plot_loss, for any metric of
metrics.jsonl and several runs)."""

from __future__ import annotations

import argparse

DEFAULT_KEYS = "loss,val_loss,lr,grad_norm,tokens_per_second"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plot", help="overlay the logged curves of one or more runs into a PNG")
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories (each with its metrics.jsonl)")
    p.add_argument("--keys", default=DEFAULT_KEYS, help=f"metrics, comma-separated (default {DEFAULT_KEYS})")
    p.add_argument("--labels", help="one per run, comma-separated (default: the directories' names)")
    p.add_argument("--out", default="curves.png", help="the PNG to write (default curves.png)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # deferred: start-up time (matplotlib, ~0.4 s; canntrain --help imports this module)
    from canntrain_core.viz.plots import plot_curves

    labels = args.labels.split(",") if args.labels else None
    out, drawn = plot_curves(args.run_dirs, [k for k in args.keys.split(",") if k], args.out, labels)
    print(f"wrote {out}: " + ", ".join(f"{key} ({n} run{'s' * (n != 1)})" for key, n in drawn.items()))
    return 0
