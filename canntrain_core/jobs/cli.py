"""`canntrain run NOTEBOOK [-p NAME VALUE]... [--run-dir DIR] [--nproc_per_node K [--nnodes N ...]]`.

A notebook, headless, into a run directory; with --nproc_per_node, once per rank under torchrun.
"""

from __future__ import annotations

import argparse
import sys


def add_parameter_option(p: argparse.ArgumentParser, value: str, help: str) -> None:
    """papermill's ``-p NAME VALUE``, repeatable (``canntrain run``, ``canntrain sweep``)."""
    p.add_argument("-p", "--parameter", nargs=2, action="append", default=[], metavar=("NAME", value), help=help)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="execute a notebook headless with papermill")
    p.add_argument("notebook")
    add_parameter_option(p, "VALUE", "notebook parameter (value read as YAML), e.g. -p max_steps 50")
    p.add_argument("--run-dir", default=None, help="where the executed notebook and its outputs go")
    p.add_argument(
        "--nproc_per_node",
        type=int,
        default=None,
        help="run the notebook once per rank under torchrun (rank 0's copy is the report)",
    )
    p.add_argument("--nnodes", default=None)
    p.add_argument("--node_rank", default=None)
    p.add_argument("--master_addr", default=None)
    p.add_argument("--master_port", default=None)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # deferred: start-up time (canntrain --help does not load jobs.papermill_runner)
    from canntrain_core.jobs.papermill_runner import describe_run, parse_parameter, run_notebook, run_notebook_ranks

    params = {name: parse_parameter(value) for name, value in args.parameter}
    multi_node = [
        f"--{k}={getattr(args, k)}"
        for k in ("nnodes", "node_rank", "master_addr", "master_port")
        if getattr(args, k) is not None
    ]
    if multi_node and not args.nproc_per_node:
        print("canntrain run: --nnodes/--node_rank/--master_* need --nproc_per_node", file=sys.stderr)
        return 2
    # A failing cell (NotebookFailed, exit 1) or a missing notebook (exit 2) leaves through canntrain_core.cli.
    if args.nproc_per_node:
        out = run_notebook_ranks(args.notebook, args.nproc_per_node, args.run_dir, params, multi_node or None)
    else:
        out = run_notebook(args.notebook, args.run_dir, params)
    print(describe_run(out.parent))
    return 0
