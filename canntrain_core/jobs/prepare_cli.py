"""``canntrain prepare SOURCE... --tokenizer DIR -o OUT [--workers N]``: raw corpora into a prepared dataset
(Megatron-format token shards + a manifest), once, before training; see ``canntrain_core/data/prepare.py``.

On several nodes every node runs the same command on the same output directory (a shared file system):
``--num-nodes`` / ``--node-rank`` default to torchrun's and Slurm's variables (NNODES / NODE_RANK,
SLURM_NNODES / SLURM_NODEID), and node k takes units k, k+m, ...; the last to finish writes the manifest.
"""

from __future__ import annotations

import argparse
import os

_SIZES = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


def _bytes(text: str) -> int:
    """'256M', '1G', '65536' -> bytes."""
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    try:
        return int(float(t[:-1]) * _SIZES[t[-1]]) if t and t[-1] in _SIZES else int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 256M, 1G)") from None


def _env_int(*names: str, default: int) -> int:
    for n in names:
        if os.environ.get(n, "").isdigit():
            return int(os.environ[n])
    return default


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "prepare",
        help="tokenize raw corpora once into a prepared dataset (Megatron .bin/.idx shards + manifest)",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("sources", nargs="+", help="directories, .jsonl[.gz|.zst], .parquet, datasets dirs, globs, stdlib")
    tok = p.add_mutually_exclusive_group(required=True)
    tok.add_argument("--tokenizer", help="a pretrained tokenizer directory (tokenizer.json or tokenizer.model)")
    tok.add_argument("--train-tokenizer", type=int, metavar="VOCAB", help="train a byte-level BPE of VOCAB tokens")
    p.add_argument("-o", "--out", required=True, help="the prepared dataset's directory (resumed if it exists)")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="processes on this node (default: cores)")
    p.add_argument("--text-field", default="text", help="the records' text key or column (default: text)")
    p.add_argument("--on-bad-record", choices=("error", "skip"), default="error")
    p.add_argument("--tokenizer-sample", type=_bytes, default="100M", help="text to train a tokenizer on")
    p.add_argument("--shard-size", type=_bytes, default=None, help="text per shard (default: corpus / 32, 8M-512M)")
    p.add_argument("--num-nodes", type=int, default=_env_int("NNODES", "SLURM_NNODES", default=1))
    p.add_argument("--node-rank", type=int, default=_env_int("NODE_RANK", "SLURM_NODEID", default=0))
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # deferred: start-up time (canntrain --help imports this module; the data path imports torch)
    from canntrain_core.data.cache import DataError
    from canntrain_core.data.prepare import PrepareOptions, prepare

    if args.train_tokenizer is not None and not 260 <= args.train_tokenizer <= 2**20:
        raise DataError(f"--train-tokenizer {args.train_tokenizer}: a vocabulary of 260 to 1048576 tokens")
    opts = PrepareOptions(text_field=args.text_field, on_bad_record=args.on_bad_record, unit_bytes=args.shard_size)
    result = prepare(
        args.sources,
        args.out,
        tokenizer=args.tokenizer,
        train_vocab=args.train_tokenizer,
        sample_bytes=args.tokenizer_sample,
        workers=args.workers,
        node_rank=args.node_rank,
        num_nodes=args.num_nodes,
        opts=opts,
        progress=not args.no_progress,
    )
    m = result.manifest
    if m is None:
        print(f"node {args.node_rank}: its {result.units_done_here} unit(s) done; the last node writes the manifest")
        return 0
    rate = m["text_bytes"] / 1e6 / max(m["seconds_last_run"], 1e-9)
    print(
        f"{result.out}: {m['documents']:,} documents, {m['tokens']:,} tokens in {len(m['shards'])} shard(s) "
        f"({m['dtype']}, vocabulary {m['tokenizer']['vocab_size']:,})"
        + ("; already complete" if result.cache_hit else f"; {m['seconds_last_run']:.1f} s, {rate:.1f} MB/s")
        + (f"; {m['bad_records']} bad record(s) skipped" if m["bad_records"] else "")
    )
    print(f"train on it with: --set data.source={result.out}")
    return 0
