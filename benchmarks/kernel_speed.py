"""Speed of each kernel backend vs eager, a whole training step, and the loss's peak memory.

    .venv/bin/python benchmarks/kernel_speed.py                      # tiny + 1B-like shapes, all ops
    .venv/bin/python benchmarks/kernel_speed.py --shapes tiny --ops rms_norm,swiglu --threads 1
    .venv/bin/python benchmarks/kernel_speed.py --json out.json

Timings are medians after warm-up (compilation is excluded). They depend on the machine and its
load; nothing in the test suite reads them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys

import torch

from canntrain_core.train.throughput import train_step_throughput
from canntrain_kernels import registry
from canntrain_kernels.bench import backend_speed, cross_entropy_peak


def _table(rows: list[dict], cols: list[str]) -> str:
    def fmt(v):
        if isinstance(v, float):
            return f"{v:.3f}" if v < 100 else f"{v:.0f}"
        return "-" if v is None else str(v)

    cells = [[fmt(r.get(c)) for c in cols] for r in rows]
    widths = [max(len(c), *(len(x[i]) for x in cells)) for i, c in enumerate(cols)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(x.ljust(w) for x, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ops", default=",".join(registry.OPS))
    p.add_argument("--shapes", default="tiny,1b")
    p.add_argument("--dtype", default="fp32")
    p.add_argument("--repeat", type=int, default=10)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--skip-train", action="store_true", help="skip the whole-training-step comparison")
    p.add_argument("--train-steps", type=int, default=5)
    p.add_argument("--json", default=None, help="also write all results to this file")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    env = dict(
        device=registry.current_device(),
        torch=torch.__version__,
        threads=torch.get_num_threads(),
        cpu=platform.processor() or platform.machine(),
        load=os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    )
    print("environment:", env, flush=True)
    out: dict = {"environment": env}

    speed = backend_speed(args.ops.split(","), args.shapes.split(","), args.dtype, repeat=args.repeat)
    out["speed"] = speed
    print("\nforward+backward per backend (median ms; speedup = eager / backend)")
    print(_table(speed, ["op", "shape", "dtype", "backend", "fwd_ms", "fwd_bwd_ms", "speedup"]), flush=True)

    if not args.skip_train:
        train = [train_step_throughput(mode, steps=args.train_steps) for mode in ("eager", "auto")]
        out["train_step"] = train
        print("\ntiny llama training step, micro-batch 8 x 128 tokens, fp32")
        print(_table(train, ["kernels", "tokens_per_s", "step_ms", "first_step_s", "select_s", "loss"]))

    mem = [cross_entropy_peak(4096, 128, 4096), cross_entropy_peak(2048, 2048, 32000)]
    out["cross_entropy_memory"] = mem
    print("\ncross-entropy forward+backward peak memory (MiB)")
    rows = [dict(m, plain_MiB=m["plain_bytes"] / 2**20, chunked_MiB=m["chunked_bytes"] / 2**20) for m in mem]
    print(_table(rows, ["n", "hidden", "vocab", "plain_MiB", "chunked_MiB", "ratio"]))

    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
