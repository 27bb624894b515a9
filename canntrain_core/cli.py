"""The `canntrain` command line. Each subcommand registers itself through a `register(subparsers)`
function in one of COMMAND_MODULES (most in jobs/, the top layer, which may import every stage).

Expected failures (:class:`canntrain_core.errors.CanntrainError`) end as one message on stderr,
``canntrain <command>: ...``, and the exit code of their kind (2 bad input, 3 out of memory,
1 otherwise); under torchrun the message also goes to the launcher's error file, so its failure
summary names it. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time

from canntrain_core.errors import CanntrainError

COMMAND_MODULES = [
    "canntrain_core.jobs.train_cli",  # train
    "canntrain_core.checkpoint.cli",  # export
    "canntrain_core.jobs.tasks_cli",  # tasks
    "canntrain_core.jobs.cli",  # run (notebooks headless)
    "canntrain_core.jobs.sweep_cli",  # sweep (a grid of notebook runs and their summary)
    "canntrain_core.jobs.overfit",  # overfit (a few samples must be learned to near-zero loss)
    "canntrain_core.memory.cli",
    "canntrain_kernels.cli",
    "canntrain_core.jobs.launch_cli",
    "canntrain_core.jobs.start_cli",  # start (the tiny recipes' starting models and data)
    "canntrain_core.jobs.generate_cli",  # generate (sample from a run, a checkpoint or an export)
    "canntrain_core.jobs.eval_cli",  # eval (lm-evaluation-harness tasks on a run, a checkpoint or an export)
    "canntrain_core.viz.cli",  # plot (several runs' curves overlaid)
    "canntrain_core.jobs.doctor",  # doctor (environment, rank map, collectives before a job)
    "canntrain_core.jobs.prepare_cli",  # prepare (raw corpora into token shards, once)
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="canntrain", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def report_failure(command: str, error: CanntrainError) -> int:
    """Print ``error`` as canntrain's one message, tell torchrun's summary, return its exit code."""
    message = f"canntrain {command}: {error}"
    print(message, file=sys.stderr)
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:  # torchrun shows this file's py_callstack as the failing rank's "traceback"
        record = {
            "message": {
                "message": f"{type(error).__name__}: {error}",
                "extraInfo": {"py_callstack": message, "timestamp": str(int(time.time()))},
            }
        }
        with open(error_file, "w") as f:
            json.dump(record, f)
    return error.exit_code


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except CanntrainError as e:
        return report_failure(args.command, e)


if __name__ == "__main__":
    sys.exit(main())
