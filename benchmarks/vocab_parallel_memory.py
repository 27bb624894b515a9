#!/usr/bin/env python
"""Peak memory of the output head and loss at Qwen's 151,936-token vocabulary: replicated vs vocabulary-parallel.

    python benchmarks/vocab_parallel_memory.py [--tokens 1024]

A tiny Qwen2 (hidden 128, 1 layer, 4 heads and KV heads, vocabulary 151,936) under TP on 2 and on 4 gloo
processes (one torchrun launch each), ``distributed.vocab_parallel`` false and true. Each rank runs forward and
backward of one batch of --tokens tokens under torch's MemTracker (the tracker ``memory.measure`` uses), which
books every tensor allocated on the rank: the peak, its parameters and gradients, and the head + loss share
(peak minus what the same step peaks at without the head: the logits, their softmax and gradient, the head's
weight and gradient). Compared with the estimator's per-rank figures for the same shape and layout. Not a
test: prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from canntrain_core.families.family import TINY_SHAPE

# the tiny shape, one layer, 4 KV heads (TP4 divides them), Qwen's vocabulary, untied
SHAPE = dict(TINY_SHAPE, num_hidden_layers=1, num_key_value_heads=4, vocab_size=151936, tie_word_embeddings=False)


def worker(out: str, tokens: int) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed._tools.mem_tracker import MemTracker

    from canntrain_core.models.lifecycle import build_training_model
    from canntrain_core.models.registry import model_config
    from canntrain_core.recipe import load_recipe
    from canntrain_core.runtime.distributed import ParallelDims

    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    ids = torch.randint(0, SHAPE["vocab_size"], (tokens // 256, 257), generator=torch.Generator().manual_seed(0))
    rows = {}
    for vocab_parallel in (False, True):
        recipe = load_recipe(
            None,
            {
                "model.preset": "tiny-qwen2",
                "model.overrides": SHAPE,
                "distributed.world_size": world,
                "distributed.tensor_parallel_size": world,
                "distributed.vocab_parallel": vocab_parallel,
            },
        )
        dims = ParallelDims.from_recipe(recipe)
        model = build_training_model(
            recipe, model_config(recipe.model), torch.device("cpu"), dims.build_mesh("cpu"), dims
        ).model
        tracker = MemTracker()
        tracker.track_external(model)
        with tracker:
            loss = model(ids[:, :-1], ids[:, 1:])
            loss.backward()
        peak = tracker.get_tracker_snapshot("peak")
        raw = {(k.value if hasattr(k, "value") else str(k)): v for k, v in next(iter(peak.values())).items()}
        rows[str(vocab_parallel)] = {"peak": raw["Total"], "loss": loss.item(), **raw}
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    dist.destroy_process_group()


def estimate_rows(world: int, tokens: int) -> dict:
    from canntrain_core.sizing.estimator import estimate
    from canntrain_core.sizing.setup import TrainSetup
    from canntrain_core.sizing.shapes import shape_from_preset

    shape = shape_from_preset("tiny-qwen2", SHAPE)
    out = {}
    for vp in (False, True):
        s = TrainSetup(precision="fp32", micro_batch=tokens // 256, seq_length=256, tp=world, vocab_parallel=vp)
        e = estimate(shape, s)
        out[str(vp)] = {"logits_loss": e.categories["logits_loss"], "parameters": e.categories["parameters"]}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.worker[0], int(args.worker[1]))
        return
    MiB = 2**20
    print(f"head + loss at vocabulary {SHAPE['vocab_size']:,}, {args.tokens} tokens per rank, fp32, gloo")
    head = ("ranks", "vocab", "peak MiB", "params MiB", "est. logits+loss MiB", "loss")
    print(" ".join(f"{h:>{w}s}" for h, w in zip(head, (5, 10, 9, 10, 21, 8))))
    for world in (2, 4):
        with tempfile.TemporaryDirectory() as d:
            out = Path(d) / "rows.json"
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}"]
            cmd += [__file__, "--worker", str(out), str(args.tokens)]
            subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True)
            rows = json.loads(out.read_text())
        est = estimate_rows(world, args.tokens)
        for vp in ("False", "True"):
            r, e = rows[vp], est[vp]
            name = "parallel" if vp == "True" else "replicated"
            print(
                f"{world:5d} {name:>10s} {r['peak'] / MiB:9.1f} {r.get('Parameter', 0) / MiB:10.1f} "
                f"{e['logits_loss'] / MiB:21.1f} {r['loss']:8.4f}"
            )


if __name__ == "__main__":
    main()
