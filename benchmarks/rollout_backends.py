#!/usr/bin/env python
"""GRPO and PPO with each rollout engine: this process's KV-cached loop, and vLLM in its own process, on-policy
(staleness 0) and one step off (staleness 1), its weights pushed as files or (s1) broadcast over gloo.

    make vllm-env && .venv/bin/python benchmarks/rollout_backends.py [--grpo-steps 30] [--ppo-steps 20]

The tiny recipes of grpo.ipynb and rlhf_ppo.ipynb, from the alignment notebooks' start (the tiny Llama pretrained
and fine-tuned on the sort task), rewarded by the checker. Prints, per stage and engine, the true score of the
first and last 6 iterations and where an iteration's time goes (jobs/rollout_compare.py). On a 2-core CPU the
engine and the trainer share the cores, so the overlap of staleness 1 shows as time, not as speed: on an
accelerator the engine has devices of its own. Not a test: a few minutes here.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from conftest import CONFIGS  # noqa: E402

from canntrain_core.jobs.alignment_start import tiny_start  # noqa: E402
from canntrain_core.jobs.rollout_compare import BROADCAST, ENGINES, format_comparison, rollout_runs  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--grpo-steps", type=int, default=30)
    ap.add_argument("--ppo-steps", type=int, default=20)
    ap.add_argument("--workdir", default=None, help="default: a new temporary directory")
    a = ap.parse_args()
    work = Path(a.workdir or tempfile.mkdtemp(prefix="rollout-backends-"))
    os.environ["CANNTRAIN_RUNS"] = str(work)  # the shared pretrained base too: never under the checkout
    start = tiny_start(work, CONFIGS)
    online = {"model.init_from": str(start.sft_hf), "data.source": str(start.prompts)}
    for stage, steps in (("grpo", a.grpo_steps), ("ppo", a.ppo_steps)):
        engines = {**ENGINES, **BROADCAST}
        runs = rollout_runs(CONFIGS / f"tiny_{stage}.yaml", {**online, "optim.max_steps": steps}, work, stage, engines)
        print(f"\n{stage.upper()}, {steps} iterations ({work})")
        print(format_comparison(runs))


if __name__ == "__main__":
    main()
