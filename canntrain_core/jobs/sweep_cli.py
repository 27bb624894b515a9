"""`canntrain sweep NOTEBOOK -p NAME v1,v2 [-p ...] [--out DIR]`: a grid of headless notebook runs and their summary
(canntrain_core/jobs/notebook_sweep.py)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from canntrain_core.jobs.cli import add_parameter_option


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sweep", help="run a notebook once per combination of parameter values; summarise the runs")
    p.add_argument("notebook")
    add_parameter_option(
        p, "VALUES", "a notebook parameter and its values, comma-separated (each read as YAML), e.g. -p max_steps 20,40"
    )
    p.add_argument("--out", default=None, help="where the runs and summary.{csv,md} go (default runs/sweep-<time>)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # deferred: start-up time (canntrain --help does not load jobs.notebook_sweep)
    from canntrain_core.jobs.notebook_sweep import parse_grid, sweep_notebook

    grid = parse_grid(args.parameter)
    out = args.out or f"runs/sweep-{time.strftime('%Y%m%d-%H%M%S')}"
    rows = sweep_notebook(args.notebook, grid, out)
    print((Path(out) / "summary.md").read_text(), end="")
    failed = [r["run"] for r in rows if r["status"] != "ok"]
    if failed:
        print(f"{len(failed)} of {len(rows)} runs failed: {', '.join(failed)}")
    return 1 if failed else 0
