#!/usr/bin/env python
"""Throughput of each parallel layout on this machine, and its traffic: measured vs estimated.

    python benchmarks/parallel_overhead.py [--nproc 2] [--steps 12]

Every layout trains the tiny recipe (global batch 8 x 128 tokens, fp32 unless named, gloo) in one torchrun
launch. Traffic is *measured* as bytes sent over the loopback interface (/proc/net/dev, `lo`: gloo
talks TCP there), taking the difference between a run of --steps and one of --steps/3 so set-up,
evaluation and checkpoint traffic cancel; it includes TCP/IP headers (a few %). The *estimate* is
canntrain_core.sizing.comm.comm_per_step. Not a test: numbers vary by machine.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "cookbook" / "llama" / "configs" / "tiny_pretrain.yaml"
BASE = {
    "data.batch_size": 8,
    "logging.log_interval": 1,
    "logging.eval_interval": 10**6,
    "logging.ckpt_interval": 10**6,
    "logging.eval_batches": 1,
    "optim.warmup_steps": 2,
}
LAYOUTS = {
    "dp2": {"distributed.data_parallel_size": 2, "data.batch_size": 4},
    "fsdp2": {"distributed.data_parallel_size": 2, "distributed.zero_optimization": 3, "data.batch_size": 4},
    "tp2": {"distributed.tensor_parallel_size": 2},
    "tp2_sp": {"distributed.tensor_parallel_size": 2, "distributed.sequence_parallel": True},
    "pp2_1f1b": {"distributed.pipeline_parallel_size": 2, "data.batch_size": 4, "optim.grad_accum_steps": 2},
    # gradient accumulation: the same global batch in 4 micro-batches per rank
    "dp2_accum4": {"distributed.data_parallel_size": 2, "data.batch_size": 1, "optim.grad_accum_steps": 4},
    "zero1_accum4": {
        "distributed.data_parallel_size": 2,
        "distributed.zero_optimization": 1,
        "data.batch_size": 1,
        "optim.grad_accum_steps": 4,
    },
    "fsdp2_accum4": {
        "distributed.data_parallel_size": 2,
        "distributed.zero_optimization": 3,
        "data.batch_size": 1,
        "optim.grad_accum_steps": 4,
    },
    # bf16: FSDP2's MixedPrecisionPolicy gathers bf16 parameters (fp32 before it existed: see fsdp2)
    "fsdp2_bf16": {
        "distributed.data_parallel_size": 2,
        "distributed.zero_optimization": 3,
        "data.batch_size": 4,
        "model.precision": "bf16",
    },
}


def lo_tx_bytes() -> int:
    for line in Path("/proc/net/dev").read_text().splitlines():
        if line.strip().startswith("lo:"):
            return int(line.split(":")[1].split()[8])
    raise RuntimeError("no loopback interface in /proc/net/dev")


def worker(out: str, steps: int) -> None:
    import torch.distributed as dist

    from canntrain_core.recipe import load_recipe
    from canntrain_core.train.metrics import read_metrics
    from canntrain_core.train.trainer import Trainer

    world = int(os.environ["WORLD_SIZE"])
    spec = json.loads((Path(out) / "spec.json").read_text())
    results = {}
    for name, overrides in spec["layouts"].items():
        traffic = {}
        for n in (steps // 3, steps):
            recipe = load_recipe(
                spec["recipe"], {**BASE, "optim.max_steps": n, "distributed.world_size": world, **overrides}
            )
            trainer = Trainer(recipe, run_dir=Path(out) / f"{name}_{n}", progress=False)
            dist.barrier()
            before = lo_tx_bytes()
            trainer.fit()
            dist.barrier()
            traffic[n] = lo_tx_bytes() - before
        rows = [r for r in read_metrics(Path(out) / f"{name}_{steps}") if "loss" in r][2:]
        results[name] = {
            "tokens_per_second": sum(r["tokens_per_second"] for r in rows) / len(rows),
            "bytes_per_step": (traffic[steps] - traffic[steps // 3]) / (steps - steps // 3),
            "recipe": overrides,
        }
    if dist.get_rank() == 0:
        (Path(out) / "results.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def measure(recipe_path: Path, layouts: dict, nproc: int, steps: int, title: str, out_name: str) -> None:
    """Train 1 process, then every layout in one torchrun launch of ``nproc``; print the table, save the JSON."""
    import subprocess

    import torch

    from canntrain_core.models import build_config
    from canntrain_core.sizing.comm import comm_per_step
    from canntrain_core.recipe import load_recipe
    from canntrain_core.runtime.distributed import ParallelDims
    from canntrain_core.train.metrics import read_metrics
    from canntrain_core.train.trainer import Trainer

    out = tempfile.mkdtemp(prefix="parallel-overhead-")
    (Path(out) / "spec.json").write_text(json.dumps({"recipe": str(recipe_path), "layouts": layouts}))
    single = load_recipe(recipe_path, {**BASE, "optim.max_steps": steps})
    Trainer(single, run_dir=Path(out) / "single", progress=False).fit()
    rows = [r for r in read_metrics(Path(out) / "single") if "loss" in r][2:]
    single_tps = sum(r["tokens_per_second"] for r in rows) / len(rows)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={nproc}",
            str(Path(__file__).resolve().with_name("parallel_overhead.py")),
            "--worker",
            out,
            str(steps),
        ],
        check=True,
    )
    results = json.loads((Path(out) / "results.json").read_text())

    print(f"torch {torch.__version__}, gloo, {nproc} processes on {os.cpu_count()} cores, {title}\n")
    print("| layout | tokens/s per device | vs 1 process | bytes/step measured (all ranks) | estimated | ratio |")
    print("|---|---|---|---|---|---|")
    print(f"| single | {single_tps:,.0f} | 1.00 | 0 | 0 | |")
    for name, res in results.items():
        recipe = load_recipe(recipe_path, {**BASE, "distributed.world_size": nproc, **res["recipe"]})
        config = build_config(recipe.model.preset, recipe.model.overrides, recipe.data.tokenizer.vocab_size)
        est = nproc * sum(
            r["bytes"]
            for r in comm_per_step(
                config,
                ParallelDims.from_recipe(recipe),
                recipe.data.batch_size,
                recipe.data.seq_length,
                recipe.optim.grad_accum_steps,
                recipe.distributed.zero_optimization,
                recipe.model.precision,
                backend="gloo",
                sequence_parallel=recipe.distributed.sequence_parallel,
                vocab_parallel=recipe.distributed.vocab_parallel,
            )
        )
        measured = res["bytes_per_step"]
        print(
            f"| {name} | {res['tokens_per_second']:,.0f} | {res['tokens_per_second'] / single_tps:.2f} | "
            f"{measured / 2**20:.1f} MiB | {est / 2**20:.1f} MiB | {measured / est:.2f} |"
        )
    (ROOT / "benchmarks" / "out").mkdir(parents=True, exist_ok=True)
    (ROOT / "benchmarks" / "out" / out_name).write_text(
        json.dumps({"single_tokens_per_second": single_tps, "layouts": results}, indent=1)
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=12)
    a = p.parse_args()
    title = "tiny Llama fp32, global batch 8 x 128 tokens"
    measure(RECIPE, LAYOUTS, a.nproc, a.steps, title, "parallel_overhead.json")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], int(sys.argv[3]))
    else:
        main()
