"""`canntrain overfit`'s command line; the check is :func:`canntrain_core.jobs.overfit.overfit`, loaded when it
runs."""

from __future__ import annotations

import argparse

from canntrain_core.errors import BadInput


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("overfit", help="check that a recipe's model drives its loss near zero on a few samples")
    p.add_argument("recipe", help="recipe YAML file")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--samples", type=int, default=32, help="rows to train on again and again (default 32)")
    p.add_argument("--steps", type=int, default=200, help="optimizer steps (default 200)")
    p.add_argument("--run-dir", default=None, help="where the run goes (default runs/overfit-<time>)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.samples < 1 or args.steps < 10:
        raise BadInput("--samples must be >= 1 and --steps >= 10")
    # deferred: start-up time (canntrain --help imports this module; the check imports torch and transformers)
    from canntrain_core.jobs.overfit import overfit, overfit_recipe

    result = overfit(overfit_recipe(args.recipe, args.overrides, args.steps), args.samples, args.run_dir)
    print(result)
    return 0 if result.passed else 1
