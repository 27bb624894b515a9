"""`canntrain sweep NOTEBOOK -p NAME v1,v2 [-p NAME2 ...] [--out DIR]`: a grid of headless runs of one notebook.

Every combination of the values runs the notebook with papermill into its own run directory (``DIR/<name>``, the
notebook's ``run_dir`` parameter), one after another here, or one job each on a cluster; a run that fails is reported
and the others go on. ``DIR/summary.csv`` and ``DIR/summary.md`` hold a row per run: its parameters, how it ended
and the last value of each metric its ``metrics.jsonl`` logged (the cann-recipes-train articles' batch runs, with
the table made for you).
"""

from __future__ import annotations

import csv
import itertools
from pathlib import Path
from typing import Any, Callable

from canntrain_core.errors import BadInput, CanntrainError
from canntrain_core.jobs.papermill_runner import parse_parameter, run_notebook
from canntrain_core.train.metrics import read_metrics

# the last values a summary reports, where a run logged them
SUMMARY_METRICS = ("loss", "val_loss", "val_exact_match", "tokens_per_second", "mfu", "peak_memory_bytes")


def parse_grid(pairs: list[tuple[str, str]]) -> dict[str, list[Any]]:
    """``-p NAME v1,v2`` pairs -> {NAME: [v1, v2]}, each value read as YAML (papermill's -p reading)."""
    grid: dict[str, list[Any]] = {}
    for name, values in pairs:
        if name in grid:
            raise BadInput(f"-p {name}: given twice; list its values once, comma-separated")
        grid[name] = [parse_parameter(v) for v in values.split(",")]
        if any(v == "" for v in values.split(",")):
            raise BadInput(f"-p {name} {values}: an empty value")
    if not grid:
        raise BadInput("no -p NAME v1,v2: nothing to sweep")
    return grid


def run_name(params: dict[str, Any]) -> str:
    """A run directory's name from its parameters: ``lr=0.001,max_steps=20``."""
    return ",".join(f"{k}={v}" for k, v in params.items()).replace("/", "_").replace(" ", "")


def sweep_notebook(
    notebook: str | Path, grid: dict[str, list[Any]], out: str | Path, run: Callable = run_notebook
) -> list[dict[str, Any]]:
    """Run ``notebook`` once per combination of ``grid`` into ``out/<run name>``; write and return the summary."""
    if not Path(notebook).is_file():
        raise BadInput(f"{notebook}: no such notebook")
    out = Path(out)
    rows = []
    for values in itertools.product(*grid.values()):
        params = dict(zip(grid, values))
        name = run_name(params)
        print(f"sweep: {name}", flush=True)
        try:
            run(notebook, out / name, params, progress=False)
            status, error = "ok", ""
        except CanntrainError as e:  # a failing cell: reported, and the grid goes on
            status, error = "failed", str(e).splitlines()[0]
        logged = read_metrics(out / name)
        last = {k: next((r[k] for r in reversed(logged) if k in r), None) for k in SUMMARY_METRICS}
        rows.append({"run": name, **params, "status": status, **last, "error": error})
    _write_summary(rows, out)
    return rows


def _write_summary(rows: list[dict[str, Any]], out: Path) -> None:
    keys = [k for k in rows[0] if any(r.get(k) not in (None, "") for r in rows) or k in ("run", "status")]
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "summary.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    cell = lambda v: "" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v)  # noqa: E731
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(cell(r.get(k)).replace("|", "/") for k in keys) + " |" for r in rows]
    (out / "summary.md").write_text("\n".join(lines) + "\n")
