"""The `canntrain` command line. Each subcommand lives next to the code it drives and
registers itself through a `register(subparsers)` function in one of COMMAND_MODULES."""

from __future__ import annotations

import argparse
import importlib
import sys

from canntrain_core.recipe import RecipeError

COMMAND_MODULES = [
    "canntrain_core.train.cli",  # train
    "canntrain_core.jobs.cli",  # run (notebooks headless)
    "canntrain_core.memory.cli",
    "kernels.cli",
    "canntrain_core.jobs.launch_cli",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="canntrain", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except RecipeError as e:
        print(f"canntrain: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
