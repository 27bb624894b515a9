"""`canntrain generate RUN_DIR|CHECKPOINT|HF_DIR --prompt TEXT [--prompt TEXT]... [--chat [--system TEXT]]
[--max-new-tokens N] [--temperature T] [--top-k K] [--seed S] [--dtype fp32|bf16|fp16]`.

Samples from a trained model with the rollouts' KV-cached decoding (``canntrain_core/jobs/generate.py``).
"""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="sample from a run, a checkpoint or a Hugging Face directory")
    p.add_argument(
        "source",
        help="a run directory (its newest complete checkpoint), a checkpoint directory, "
        "or a Hugging Face model directory (e.g. a `canntrain export`)",
    )
    p.add_argument(
        "--prompt",
        action="append",
        required=True,
        help="text to continue (with --chat: the user's message); repeat for a batch",
    )
    p.add_argument(
        "--chat", action="store_true", help="format the prompt with the model's chat template and its generation prompt"
    )
    p.add_argument("--system", default=None, help="with --chat: a system message before the prompt")
    p.add_argument("--max-new-tokens", type=int, default=64, help="at most this many tokens per answer (default 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 (the default): greedy; else sampling")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens (0: all)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32", help="weights' dtype (default fp32)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # deferred: start-up time (canntrain --help does not load jobs.generate)
    from canntrain_core.jobs.generate import load_generator

    gen = load_generator(args.source, dtype=args.dtype)
    done = gen.generate(
        args.prompt,
        chat=args.chat,
        system=args.system,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        seed=args.seed,
    )
    for i, c in enumerate(done):
        if len(done) > 1:
            print(f"[{i + 1}] {c.prompt}")
        print(c.text if c.ended else c.text + f"  [no end token after {len(c.ids)} tokens]")
    return 0
