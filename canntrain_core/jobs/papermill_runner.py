"""Run a cookbook notebook headless with papermill, the executed copy landing in the run directory."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from canntrain_core.checkpoint import list_checkpoints
from canntrain_core.errors import BadInput, CanntrainError
from canntrain_core.train.metrics import read_metrics


class NotebookFailed(CanntrainError, RuntimeError):
    """A cell raised; the message names the cell and the error, and where the executed notebook is."""


def parse_parameter(raw: str) -> Any:
    """Read a -p value the way YAML would: 1e-4, true, {optim.lr: 1e-4}, [a, b]; else keep the string."""
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw
    if isinstance(value, str) and re.fullmatch(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+", value):
        return float(value)  # YAML 1.1 reads 1e-4 (no dot) as a string; a number is meant
    return value


def default_run_dir(notebook: Path) -> Path:
    return Path("runs") / f"{notebook.stem}-{time.strftime('%Y%m%d-%H%M%S')}"


def execute(notebook: str | Path, out: str | Path, parameters: dict[str, Any], progress: bool = True) -> Path:
    """Execute ``notebook`` into ``out`` with papermill, in the notebook's own folder (as JupyterLab does)."""
    # deferred: start-up time (papermill, ~1.5 s, only to execute a notebook in this process)
    import papermill as pm
    from papermill.exceptions import PapermillExecutionError

    nb, out = Path(notebook).resolve(), Path(out).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        pm.execute_notebook(str(nb), str(out), parameters=parameters, cwd=str(nb.parent), progress_bar=progress)
    except PapermillExecutionError as e:
        raise NotebookFailed(
            f"{nb.name}: cell {e.cell_index} (execution count {e.exec_count}) raised {e.ename}: {e.evalue}\n"
            f"  the executed notebook with the full traceback: {out}"
        ) from None
    return out


def run_notebook(
    notebook: str | Path,
    run_dir: str | Path | None = None,
    parameters: dict[str, Any] | None = None,
    progress: bool = True,
) -> Path:
    """Execute ``notebook`` in this process; return the path of the executed copy in the run directory.

    The notebook receives ``run_dir`` as a parameter, so everything it writes lands next to it.
    """
    nb = Path(notebook).resolve()
    if not nb.is_file():
        raise BadInput(f"{notebook}: no such notebook")
    run_dir = Path(run_dir or default_run_dir(nb)).resolve()
    return execute(nb, run_dir / nb.name, {"run_dir": str(run_dir), **(parameters or {})}, progress)


def run_notebook_ranks(
    notebook: str | Path,
    nproc_per_node: int,
    run_dir: str | Path | None = None,
    parameters: dict[str, Any] | None = None,
    torchrun_args: list[str] | None = None,
) -> Path:
    """Execute ``notebook`` once per rank under torchrun; return rank 0's executed copy.

    ``torchrun_args`` carries multi-node options (--nnodes, --node_rank, --master_addr, --master_port);
    without them the job is single-node (--standalone).
    """
    nb = Path(notebook).resolve()
    if not nb.is_file():
        raise BadInput(f"{notebook}: no such notebook")
    run_dir = Path(run_dir or default_run_dir(nb)).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    launch = torchrun_args or ["--standalone"]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *launch,
        f"--nproc_per_node={nproc_per_node}",
        "-m",
        "canntrain_core.jobs.rank_notebook",
        str(nb),
        str(run_dir),
        json.dumps(parameters or {}),
    ]
    proc = subprocess.run(cmd)
    if proc.returncode != 0:
        raise NotebookFailed(
            f"{nb.name}: the per-rank job failed (exit {proc.returncode}); "
            f"torchrun's summary above names the rank, executed notebooks are in {run_dir}"
        )
    return run_dir / nb.name


def describe_run(run_dir: str | Path) -> str:
    """What a run directory holds and how the run ended, for the end of `make run`."""
    run_dir = Path(run_dir)
    lines = [f"run directory: {run_dir}"]
    for name, what in [
        ("recipe.resolved.yaml", "the recipe as it ran"),
        ("metrics.jsonl", "one JSON line per log step"),
        ("data.json", "what the data pipeline read, skipped and built"),
    ]:
        if (run_dir / name).is_file():
            lines.append(f"  {name:<24} {what}")
    ckpts = list_checkpoints(run_dir / "checkpoints")
    if ckpts:
        lines.append(f"  {'checkpoints/':<24} {', '.join(p.name for p in ckpts)}")
    for png in sorted(run_dir.glob("plots/*.png")):
        lines.append(f"  {str(png.relative_to(run_dir)):<24} plot")
    for nb in sorted(run_dir.glob("*.ipynb")):
        lines.append(f"  {nb.name:<24} executed notebook")
    rows = read_metrics(run_dir)
    train = [r for r in rows if "loss" in r]
    val = [r for r in rows if "val_loss" in r]
    if train:
        lines.append(f"final train loss {train[-1]['loss']:.4f} at step {train[-1]['step']}")
    if val:
        first = val[0]
        lines.append(
            f"val loss {val[-1]['val_loss']:.4f} at step {val[-1]['step']} "
            f"(was {first['val_loss']:.4f} at step {first['step']})"
        )
    return "\n".join(lines)
