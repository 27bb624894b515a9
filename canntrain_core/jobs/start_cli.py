"""`canntrain start [DIR]`: what the tiny fine-tuning and alignment recipes start from, in DIR (default runs).

The shipped tiny recipes read ``runs/tiny_pretrained_hf`` (SFT, LoRA), ``runs/tiny_sft_hf`` (reward
model, DPO, GRPO, PPO) and the task data ``runs/tasks.jsonl``, ``runs/prompts.jsonl``, ``runs/pairs.jsonl``.
This makes all five with :func:`canntrain_core.jobs.alignment_start.tiny_start` (60 pretraining steps on the standard
library, 100 SFT steps on the verifiable tasks: about a minute on two CPU cores) and copies them into
place. What already exists there is kept, never overwritten.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from canntrain_core.errors import BadInput


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("start", help="make the tiny recipes' starting models and data (runs/tiny_*_hf, runs/*.jsonl)")
    p.add_argument("directory", nargs="?", default="runs", help="where the recipes look for them (default: runs)")
    p.add_argument("--cache", default=None, help="where the start is trained and cached (default: DIRECTORY/.start)")
    p.add_argument(
        "--configs",
        default="cookbook/llama/configs",
        help="the recipe folder holding tiny_pretrain.yaml and tiny_sft.yaml (default: cookbook/llama/configs)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # deferred: start-up time (canntrain --help does not load jobs.alignment_start)
    from canntrain_core.jobs.alignment_start import tiny_start

    if not (Path(args.configs) / "tiny_pretrain.yaml").is_file():
        raise BadInput(
            f"--configs {args.configs}: no tiny_pretrain.yaml there; run canntrain start from the repository's root "
            "or pass --configs with the cookbook's recipe folder (cookbook/llama/configs)"
        )
    out = Path(args.directory)
    start = tiny_start(args.cache or out / ".start", args.configs)
    made = {
        "tiny_pretrained_hf": start.pretrained_hf,
        "tiny_sft_hf": start.sft_hf,
        "tasks.jsonl": start.sft_run.parent / "tasks.jsonl",
        "prompts.jsonl": start.prompts,
        "pairs.jsonl": start.pairs,
    }
    for name, source in made.items():
        target = out / name
        if target.exists():
            print(f"{target}: exists, kept")
            continue
        (shutil.copytree if source.is_dir() else shutil.copyfile)(source, target)
        print(f"{target}: written")
    return 0
