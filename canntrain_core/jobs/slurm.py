"""Render scripts/slurm/pretrain.sbatch for one recipe.

The template holds ``@@NAME@@`` markers (not ``$NAME``: the script is full of shell variables).
The job runs one task per node; each task calls scripts/run_pretrain.sh with the node's
``$SLURM_NODEID`` as ``--node_rank`` and the first host of ``$SLURM_JOB_NODELIST`` as master.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from canntrain_core.errors import BadInput
from canntrain_core.recipe import load_recipe

REPO = Path(__file__).resolve().parents[2]
TEMPLATE = REPO / "scripts" / "slurm" / "pretrain.sbatch"
# Slurm GRES names: GPUs are "gpu" everywhere; Ascend clusters register their NPUs as "npu".
GRES = {"npu": "npu", "cuda": "gpu", "cpu": None}
_TIME = re.compile(r"^(\d+-)?\d{1,2}:\d{2}:\d{2}$|^\d+$")


class SlurmError(BadInput, ValueError):
    """Arguments that cannot make a valid job (the message says which and why)."""


@dataclass
class SlurmJob:
    """Everything the template needs; ``render`` checks it against the recipe first."""

    recipe: str
    nodes: int
    devices_per_node: int = 8
    device_type: str = "npu"
    partition: str | None = None
    time: str | None = None
    overrides: list[str] = field(default_factory=list)


def _job_name(name: str) -> str:
    """experiment.name made safe for --job-name (letters, digits, . _ -)."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_") or "canntrain"


def _validate(job: SlurmJob, world_size: int) -> None:
    problems = []
    if job.nodes < 1:
        problems.append(f"--nodes must be at least 1, got {job.nodes}")
    if job.devices_per_node < 1:
        problems.append(f"--devices-per-node must be at least 1, got {job.devices_per_node}")
    if job.device_type not in GRES:
        problems.append(f"--device-type must be one of {sorted(GRES)}, got {job.device_type!r}")
    if job.time is not None and not _TIME.match(job.time):
        problems.append(f"--time must be HH:MM:SS, D-HH:MM:SS or minutes, got {job.time!r}")
    if job.partition is not None and not re.fullmatch(r"[A-Za-z0-9._,-]+", job.partition):
        problems.append(f"--partition {job.partition!r} is not a partition name")
    if not problems and job.nodes * job.devices_per_node != world_size:
        hint = ""
        if world_size % job.devices_per_node == 0:
            hint = f"; use --nodes {world_size // job.devices_per_node}"
        problems.append(
            f"{job.recipe}: distributed.world_size={world_size} but --nodes {job.nodes} x --devices-per-node "
            f"{job.devices_per_node} = {job.nodes * job.devices_per_node} processes{hint}"
        )
    if problems:
        raise SlurmError("canntrain slurm: " + "\n  ".join(problems))


def render(job: SlurmJob, template: Path = TEMPLATE) -> str:
    """The sbatch script for ``job``; RecipeError for a bad recipe, SlurmError for bad arguments."""
    recipe = load_recipe(job.recipe, job.overrides)
    _validate(job, recipe.distributed.world_size)
    optional = []
    if GRES[job.device_type]:
        optional.append(f"#SBATCH --gres={GRES[job.device_type]}:{job.devices_per_node}")
    if job.partition:
        optional.append(f"#SBATCH --partition={job.partition}")
    if job.time:
        optional.append(f"#SBATCH --time={job.time}")
    extra = "".join(f" \\\n  --set {shlex.quote(o)}" for o in job.overrides)
    values = {
        "JOB_NAME": _job_name(recipe.experiment.name),
        "NODES": str(job.nodes),
        "DEVICES": str(job.devices_per_node),
        "DEVICE_TYPE": job.device_type,
        "RECIPE": shlex.quote(str(Path(job.recipe).resolve())),
        "REPO": str(REPO),
        "OPTIONAL_SBATCH": "\n".join(optional),
        "EXTRA_ARGS": extra,
    }
    text = template.read_text()
    for key, value in values.items():
        text = text.replace(f"@@{key}@@", value)
    left = sorted(set(re.findall(r"@@([A-Z_]+)@@", text)))
    if left:
        raise SlurmError(f"{template}: markers with no value: {left}")
    # An empty optional block would leave a blank line among the #SBATCH lines; drop it.
    return re.sub(r"\n\n(?=set -euo)", "\n", text) if not optional else text
