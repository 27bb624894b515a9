"""`canntrain tasks OUT.jsonl [--n 4000] [--seed 0] [--kinds reverse,sort,add,upper] [--pairs]`: instruction data
with answers a program can check (canntrain_core/finetune/tasks.py), for the tiny SFT, LoRA, GRPO and PPO recipes;
``--pairs``: preference pairs ranked by the same check, for the reward model and DPO (finetune/alignment_data.py)."""

from __future__ import annotations

import argparse

from canntrain_core.errors import BadInput
from canntrain_core.finetune.tasks import KINDS, task_records


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tasks", help="write verifiable instruction data (JSONL) for the tiny fine-tuning recipes")
    p.add_argument("output", help="the .jsonl file to write")
    p.add_argument("--n", type=int, default=4000, help="records (default 4000)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated, of {', '.join(KINDS)}")
    p.add_argument("--pairs", action="store_true", help="preference pairs {prompt, chosen, rejected} instead")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    kinds = tuple(k for k in args.kinds.split(",") if k)
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or not kinds or args.n < 1:
        raise BadInput(
            f"--kinds: unknown {', '.join(unknown)} (known: {', '.join(KINDS)})"
            if unknown
            else "--n must be >= 1 and --kinds name at least one task"
        )
    # deferred: start-up time (canntrain --help imports this module; these import torch)
    from canntrain_core.finetune.alignment_data import preference_records
    from canntrain_core.finetune.data import write_jsonl

    make = preference_records if args.pairs else task_records
    path = write_jsonl(args.output, make(args.n, args.seed, kinds))
    print(f"wrote {args.n} {'preference pairs' if args.pairs else 'records'} ({', '.join(kinds)}) to {path}")
    return 0
