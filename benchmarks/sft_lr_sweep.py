#!/usr/bin/env python
"""Which fine-tuning learning rate holds on the tiny task: the cann-recipes-train articles' "10x the pretraining lr"
or "about 1e-5"?

    .venv/bin/python benchmarks/sft_lr_sweep.py [--steps 300] [--lrs 1e-5,3e-4,3e-3,3e-2]

Takes the tiny Llama pretrained for 60 steps on the stdlib (lr 3e-3; ``pretrained_base``, the notebooks' base),
then fine-tunes it on the sort/uppercase task with each lr, full SFT and LoRA (tiny_sft.yaml / tiny_lora.yaml
settings), and prints held-out loss and exact match. Not a test: a few minutes on two CPU cores.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from conftest import CONFIGS  # noqa: E402

from canntrain_core.jobs.alignment_start import pretrained_base  # noqa: E402
from canntrain_core.finetune.data import write_jsonl  # noqa: E402
from canntrain_core.jobs.sweep import format_sweep, lr_sweep  # noqa: E402
from canntrain_core.finetune.tasks import task_records  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--lrs", default="1e-5,3e-4,3e-3,3e-2")
    a = ap.parse_args()
    out = Path(tempfile.mkdtemp(prefix="sft-lr-sweep-"))
    hf = pretrained_base(CONFIGS, workdir=out)  # the base sft.ipynb, lora.ipynb and the tests start from
    src = write_jsonl(out / "tasks.jsonl", task_records(4000, seed=0, kinds=("sort", "upper")))
    keys = {"model.init_from": str(hf), "data.source": str(src), "logging.eval_exact_match": 64}
    rows = lr_sweep(
        ROOT / "cookbook" / "llama" / "configs" / "tiny_sft.yaml",
        keys,
        [float(x) for x in a.lrs.split(",")],
        out,
        steps=a.steps,
    )
    print(f"pretraining lr 3e-3; {a.steps} fine-tuning steps of 32 packed rows; 64 held-out answers\n")
    print(format_sweep(rows))


if __name__ == "__main__":
    main()
