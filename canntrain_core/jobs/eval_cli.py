"""`canntrain eval RUN_DIR|CHECKPOINT|HF_DIR --tasks T[,T...] [--include-path DIR] [--limit N] [--batch-size B]
[--num-fewshot K] [--chat] [--n-items N] [--dtype fp32|bf16|fp16] [--output FILE]`.

EleutherAI's lm-evaluation-harness on a run, a checkpoint (no export needed: ``jobs/harness.py``) or a Hugging Face
directory, with the harness's task names. Nothing is downloaded: a task's data must be on disk, as the harness's
YAML tasks pointing at local files (``--include-path``) or in the harness's datasets cache; ``canntrain_<kind>``
names canntrain's own verifiable tasks (``canntrain tasks``' kinds: reverse, sort, add, upper), written as harness
tasks on the fly. Prints the harness's table and writes its results as JSON in the run directory's ``eval/``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from canntrain_core.errors import BadInput


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="lm-evaluation-harness tasks on a run, a checkpoint or a Hugging Face directory")
    p.add_argument("source", help="a run directory (its newest complete checkpoint), a checkpoint or a HF directory")
    p.add_argument(
        "--tasks",
        required=True,
        help="comma-separated harness task names; canntrain_<kind> (reverse, sort, add, upper): canntrain's own",
    )
    p.add_argument("--include-path", default=None, help="a folder of the harness's YAML task files (local data)")
    p.add_argument("--limit", type=int, default=None, help="at most this many items per task")
    p.add_argument("--batch-size", type=int, default=8, help="rows per forward when scoring (default 8)")
    p.add_argument("--num-fewshot", type=int, default=None, help="few-shot examples (default: the task's)")
    p.add_argument("--chat", action="store_true", help="each context as a user turn of the model's chat template")
    p.add_argument("--n-items", type=int, default=100, help="items of each canntrain_<kind> task (default 100)")
    p.add_argument(
        "--max-length",
        type=int,
        default=None,
        help="tokens per row (default: the model's positions; logging.eval_tasks in the loop uses data.seq_length)",
    )
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32", help="weights' dtype (default fp32)")
    p.add_argument("--output", default=None, help="the results' JSON file (default: <run>/eval/<time>.json)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        # deferred: start-up time and an optional dependency (lm-evaluation-harness, the eval extra)
        from canntrain_core.jobs.harness import evaluate, results_path
    except ImportError as e:
        raise BadInput(
            f"canntrain eval runs EleutherAI's lm-evaluation-harness, which is not installed ({e}): "
            "pip install lm_eval (or pip install -e .[eval])"
        ) from None

    tasks = [t for t in args.tasks.split(",") if t]
    if not tasks:
        raise BadInput("--tasks: name at least one task")
    out = Path(args.output) if args.output else results_path(args.source) / f"{time.strftime('%Y%m%d-%H%M%S')}.json"
    results, table = evaluate(
        args.source,
        tasks,
        include_path=args.include_path,
        limit=args.limit,
        batch_size=args.batch_size,
        num_fewshot=args.num_fewshot,
        chat=args.chat,
        n_items=args.n_items,
        dtype=args.dtype,
        work=out.parent,
        max_length=args.max_length,
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1, default=str))
    print(table)
    print(f"results: {out}")
    return 0
