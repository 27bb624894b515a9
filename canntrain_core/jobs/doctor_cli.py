"""`canntrain doctor`'s command line; the checks are in :mod:`canntrain_core.jobs.doctor`, loaded when it runs."""

from __future__ import annotations

import argparse

DEFAULT_TIMEOUT = 60
LAUNCH = "torchrun --nproc_per_node K [--nnodes N ...] -m canntrain_core.cli doctor RECIPE"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "doctor",
        help="check the environment, rank map and collectives of a job before it trains (launch it like the job)",
        description=f"Launch like the job: {LAUNCH}. As one process: the environment only.",
    )
    p.add_argument("recipe", help="recipe YAML file")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT,
        help=f"seconds to wait for a rank at each step, and the process group's timeout (default {DEFAULT_TIMEOUT})",
    )
    p.add_argument("--max-bytes", default=None, help="largest message, e.g. 64MiB (default 4MiB on CPU, else 256MiB)")
    p.add_argument("--delay-rank", type=int, default=None, metavar="R", help="rehearsal: make rank R start late")
    p.add_argument("--delay-seconds", type=float, default=0.0, metavar="S", help="... by S seconds (a straggler)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # deferred: start-up time (canntrain --help imports this module; the doctor imports torch)
    from canntrain_core.jobs.doctor import run as doctor

    return doctor(args)
