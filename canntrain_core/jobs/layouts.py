"""Train one recipe under several parallel layouts in a single torchrun launch.

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
import subprocess
import sys
from pathlib import Path

import torch.distributed as dist

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
    """Start ``nproc`` local processes (gloo on CPU) that train every layout; return their output.

    ``layouts`` maps a run name (``NAME``, ``NAME@STEP`` or ``NAME<CHECKPOINT``) to its overrides.
    Raises RuntimeError with the output's tail when the job fails.
    """
    specs = [f"{name}={json.dumps(o)}" for name, o in layouts.items()]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        "-m",
        "canntrain_core.jobs.layouts",
        str(recipe_path),
        str(out),
        json.dumps(base),
        *specs,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"layouts job failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return proc.stdout


if __name__ == "__main__":
    recipe_path, out, base_json, *specs = sys.argv[1:]
    run_layouts(recipe_path, out, json.loads(base_json), specs)
    sys.stdout.flush()
    sys.stderr.flush()
    # Every layout has finished and written its files, and gloo is torn down; now and then a rank then aborted in C++
    # static destruction at interpreter exit ("terminate called without an active exception", as tests/_ep_ranks.py
    # saw): leave without running those destructors.
    os._exit(0)
