#!/usr/bin/env python
"""Expert parallelism on this machine: tiny-moe under FSDP2 over 4 gloo processes with EP 1, 2 and 4, its
throughput and its traffic, measured vs estimated.

    python benchmarks/moe_dispatch.py [--nproc 4] [--steps 12]

The measurement is parallel_overhead.py's (bytes sent over the loopback interface, the difference of a long
and a short run); the estimate is canntrain_core.sizing.comm.comm_per_step, which assumes even routing. On CPU a
rank's experts run as a loop over them (torch._grouped_mm's grouped kernel is CUDA's, bf16), so grouped vs
looped needs an accelerator. Not a test: numbers vary by machine.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from parallel_overhead import ROOT, measure  # noqa: E402

RECIPE = ROOT / "cookbook" / "moe" / "configs" / "tiny_moe.yaml"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--steps", type=int, default=12)
    a = p.parse_args()
    fsdp = {
        "distributed.data_parallel_size": a.nproc,
        "distributed.zero_optimization": 3,
        "data.batch_size": 8 // a.nproc,
    }
    eps = [e for e in (1, 2, 4, 8) if a.nproc % e == 0]
    layouts = {f"fsdp{a.nproc}_ep{e}": {**fsdp, "distributed.expert_parallel_size": e} for e in eps}
    title = "tiny-moe fp32 (8 experts, top-2), global batch 8 x 128 tokens"
    measure(RECIPE, layouts, a.nproc, a.steps, title, "moe_dispatch.json")


if __name__ == "__main__":
    main()
