"""The `canntrain` command line. Each subcommand registers itself through a `register(subparsers)`
function in its module of COMMANDS (most in jobs/, the top layer, which may import every stage).

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

# Each command and the module that registers it. Only the chosen command's module is imported (a command that needs
# no model, such as doctor on every rank of a job, starts without transformers: 2 s instead of 6 here); --help and an
# unknown command import them all.
COMMANDS = {
    "train": "canntrain_core.jobs.train_cli",
    "export": "canntrain_core.jobs.export_cli",
    "tasks": "canntrain_core.jobs.tasks_cli",
    "run": "canntrain_core.jobs.cli",  # notebooks headless
    "sweep": "canntrain_core.jobs.sweep_cli",  # a grid of notebook runs and their summary
    "overfit": "canntrain_core.jobs.overfit_cli",  # a few samples must be learned to near-zero loss
    "estimate": "canntrain_core.memory.cli",
    "plan": "canntrain_core.memory.cli",
    "kernels": "canntrain_kernels.cli",
    "rank-table": "canntrain_core.jobs.launch_cli",
    "slurm": "canntrain_core.jobs.launch_cli",
    "start": "canntrain_core.jobs.start_cli",  # the tiny recipes' starting models and data
    "generate": "canntrain_core.jobs.generate_cli",  # sample from a run, a checkpoint or an export
    "eval": "canntrain_core.jobs.eval_cli",  # lm-evaluation-harness tasks on a run, a checkpoint or an export
    "plot": "canntrain_core.viz.cli",  # several runs' curves overlaid
    "doctor": "canntrain_core.jobs.doctor_cli",  # environment, rank map, collectives before a job
    "prepare": "canntrain_core.jobs.prepare_cli",  # raw corpora into token shards, once
}


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser of ``argv``'s command (every command's when it names none of them)."""
    parser = argparse.ArgumentParser(prog="canntrain", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    argv = sys.argv[1:] if argv is None else argv
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name in dict.fromkeys([COMMANDS[chosen]] if chosen in COMMANDS else COMMANDS.values()):
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
    args = build_parser(argv).parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except CanntrainError as e:
        return report_failure(args.command, e)


if __name__ == "__main__":
    sys.exit(main())
