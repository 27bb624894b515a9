"""`canntrain run NOTEBOOK [-p NAME VALUE]... [--run-dir DIR]`: a notebook, headless, into a run directory."""

from __future__ import annotations

import argparse
import sys


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="execute a notebook headless with papermill")
    p.add_argument("notebook")
    p.add_argument("-p", "--parameter", nargs=2, action="append", default=[], metavar=("NAME", "VALUE"),
                   help="notebook parameter (value read as YAML), e.g. -p max_steps 50")
    p.add_argument("--run-dir", default=None, help="where the executed notebook and its outputs go")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from canntrain_core.jobs.papermill_runner import NotebookFailed, describe_run, parse_parameter, run_notebook

    params = {name: parse_parameter(value) for name, value in args.parameter}
    try:
        out = run_notebook(args.notebook, args.run_dir, params)
    except (NotebookFailed, FileNotFoundError) as e:
        print(f"canntrain run: {e}", file=sys.stderr)
        return 1
    print(describe_run(out.parent))
    return 0
