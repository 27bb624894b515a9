"""Train one recipe under several parallel layouts in a single launch: :func:`launch_layouts` from Python (the
notebooks, the tests), or torchrun from a shell

    python -m torch.distributed.run --standalone --nproc_per_node N \\
        -m canntrain_core.jobs.layouts RECIPE OUT OVERRIDES_JSON LAYOUT [LAYOUT...]

A LAYOUT is ``NAME=JSON`` (dotted-key overrides, e.g. ``tp2={"distributed.tensor_parallel_size": 2}``);
``NAME@STEP=JSON`` stops after STEP steps; ``NAME<CHECKPOINT=JSON`` resumes from a checkpoint.
Each run lands in OUT/NAME. Importing torch costs seconds per process, so comparing layouts
(the mesh notebook, the parity tests, the overhead benchmark) launches once, not once per layout.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch.distributed as dist

from canntrain_core.jobs.local_ranks import run_local_ranks
from canntrain_core.recipe import load_recipe
from canntrain_core.stages import make_trainer


def parse_layout(spec: str) -> tuple[str, int | None, str | None, dict]:
    """``name[@stop][<checkpoint]=json`` -> (name, stop, checkpoint, overrides)."""
    head, _, body = spec.partition("=")
    overrides = json.loads(body) if body else {}
    resume = None
    if "<" in head:
        head, resume = head.split("<", 1)
    stop = None
    if "@" in head:
        head, stop_text = head.split("@", 1)
        stop = int(stop_text)
    return head, stop, resume, overrides


def run_layouts(recipe_path: str, out: str | Path, base: dict, layouts: list[str], progress: bool = False) -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    for spec in layouts:
        name, stop, resume, overrides = parse_layout(spec)
        recipe = load_recipe(recipe_path, {**base, "distributed.world_size": world, **overrides})
        make_trainer(recipe, run_dir=Path(out) / name, resume_from=resume, progress=progress).fit(stop_after=stop)
    if dist.is_initialized():
        dist.barrier()  # no rank tears gloo down while another is still in its last exchange
        dist.destroy_process_group()


def launch_layouts(
    recipe_path: str | Path, out: str | Path, nproc: int, base: dict, layouts: dict[str, dict], timeout: float = 900
) -> str:
    """Train every layout on ``nproc`` local ranks (gloo on CPU) of one job; return the ranks' output, rank 0's first.

    ``layouts`` maps a run name (``NAME``, ``NAME@STEP`` or ``NAME<CHECKPOINT``) to its overrides. The ranks are
    forked from a process that has imported the stack once (:mod:`canntrain_core.jobs.local_ranks`), each keeping its
    output in OUT/logs/. Raises RuntimeError (``RanksFailed``) with a failed rank's output's tail.
    """
    specs = [f"{name}={json.dumps(o)}" for name, o in layouts.items()]
    (Path(out) / "logs").mkdir(parents=True, exist_ok=True)
    logs = tempfile.mkdtemp(prefix=time.strftime("%Y%m%d-%H%M%S-"), dir=Path(out) / "logs")  # one folder a launch
    outputs = run_local_ranks(run_layouts, (str(recipe_path), str(out), base, specs), nproc, logs, timeout=timeout)
    return "".join(outputs)


if __name__ == "__main__":
    recipe_path, out, base_json, *specs = sys.argv[1:]
    run_layouts(recipe_path, out, json.loads(base_json), specs)
    sys.stdout.flush()
    sys.stderr.flush()
    # Every layout has finished and written its files, and gloo is torn down; now and then a rank then aborted in C++
    # static destruction at interpreter exit ("terminate called without an active exception", as tests/_ep_ranks.py
    # saw): leave without running those destructors.
    os._exit(0)
