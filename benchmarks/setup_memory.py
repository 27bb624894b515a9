"""Host memory per rank from process start to the first training step: canntrain's meta path against
building the whole model on the host first (what the trainer did before), 1 process and 4 gloo ranks.

    .venv/bin/python benchmarks/setup_memory.py            # 445M-parameter Llama, about 3 minutes
    .venv/bin/python benchmarks/setup_memory.py --layers 2 # quicker, smaller model

Each row is the worst rank of one launch of ``canntrain_core.memory.setup_rss``. Expected shape
(meta path): a rank of 4 holds a quarter of the parameters, plus one full parameter while it fills
them, plus the fixed runtime (torch + transformers imported, process group up).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

LAYOUTS = {
    "1 process": (1, {}),
    "FSDP2 x 4": (4, {"distributed.data_parallel_size": 4, "distributed.zero_optimization": 3}),
    "TP2 x FSDP2": (
        4,
        {
            "distributed.data_parallel_size": 2,
            "distributed.zero_optimization": 3,
            "distributed.tensor_parallel_size": 2,
        },
    ),
}


def launch(nproc: int, overrides: dict, path: str) -> list[dict]:
    out = tempfile.mkdtemp()
    module = ["-m", "canntrain_core.memory.setup_rss", out, json.dumps(overrides), path]
    cmd = (
        [sys.executable, *module]
        if nproc == 1
        else [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *module]
    )
    subprocess.run(cmd, check=True, capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return [json.loads(p.read_text()) for p in sorted(Path(out).glob("rank*.json"))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    args = ap.parse_args()
    shape = {
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "num_hidden_layers": args.layers,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "vocab_size": 8192,
    }
    gib = 2**30
    print("| layout | path | peak RSS per rank GiB | runtime GiB | parameters held GiB | vs 1 process |")
    print("|---|---|---|---|---|---|")
    single = {}
    for name, (nproc, layout) in LAYOUTS.items():
        for path in ("host", "meta"):
            rows = launch(nproc, {"model.overrides": shape, **layout}, path)
            worst = max(rows, key=lambda r: r["setup_peak_rss"])
            single.setdefault(path, worst["setup_peak_rss"])
            total = single.setdefault("params", worst["local_param_bytes"])  # the 1-process row holds all
            print(
                f"| {name} | {path} | {worst['setup_peak_rss'] / gib:.2f} | {worst['runtime_rss'] / gib:.2f} | "
                f"{worst['local_param_bytes'] / gib:.2f} | {worst['setup_peak_rss'] / single[path]:.2f} |",
                flush=True,
            )
    print(
        f"\nmodel: {total / gib:.2f} GiB of fp32 parameters; "
        f"largest one {rows[0]['largest_param_bytes'] / 2**20:.0f} MiB"
    )


if __name__ == "__main__":
    main()
