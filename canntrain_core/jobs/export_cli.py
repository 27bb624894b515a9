"""`canntrain export RUN_DIR|CHECKPOINT -o DIR [--dtype bf16|fp32] [--max-shard-size 5GB]`."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="write a checkpoint as a Hugging Face model directory")
    p.add_argument("source", help="a run directory (its newest complete checkpoint) or a checkpoint directory")
    p.add_argument("-o", "--output", required=True, help="the new Hugging Face directory (must not exist)")
    p.add_argument(
        "--dtype",
        choices=["bf16", "fp16", "fp32"],
        default=None,
        help="weights' dtype (default: the recipe's precision; fp32 recipes export fp32)",
    )
    p.add_argument("--max-shard-size", default="5GB", help="largest safetensors file, e.g. 5GB, 500MB (default 5GB)")
    p.add_argument(
        "--merge",
        action="store_true",
        help="a LoRA run: write the base model with the adapters folded in (default: the peft adapter)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # deferred: start-up time (canntrain --help imports this module; the export imports torch and transformers)
    from canntrain_core.checkpoint.export import export_hf

    done = export_hf(args.source, args.output, args.dtype, args.max_shard_size, merge=args.merge)
    print(
        f"exported {done.checkpoint} -> {done.out}: {done.tensors} tensors, {done.bytes / 2**20:,.1f} MiB "
        f"in {len(done.files)} safetensors file(s)"
    )
    return 0
