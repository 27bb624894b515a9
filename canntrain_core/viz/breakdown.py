"""Where a run's step time went (``logging.profile.enabled``): a table over the run and a stacked bar per logged
interval, read from metrics.jsonl's ``time/<phase>`` (seconds per step) and ``step_time``."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt

from canntrain_core.train.metrics import read_metrics
from canntrain_core.train.timing import PHASES


def profiled_rows(run_dir: str | Path) -> list[dict]:
    rows = [r for r in read_metrics(run_dir) if "step_time" in r and any(f"time/{p}" in r for p in PHASES)]
    if not rows:
        raise ValueError(f"{run_dir}: no step-time breakdown logged (train with --set logging.profile.enabled=true)")
    return rows


def _parts(row: dict) -> dict[str, float]:
    """Seconds per step of each phase the row has, and ``other`` (the schedule, logging: the rest of the step)."""
    parts = {p: row[f"time/{p}"] for p in PHASES if f"time/{p}" in row}
    parts["other"] = max(0.0, row["step_time"] - sum(parts.values()))
    return parts


def breakdown_table(run_dir: str | Path) -> list[dict]:
    """One row per phase: mean seconds per step over the logged intervals and share of the mean step."""
    rows = profiled_rows(run_dir)
    step = sum(r["step_time"] for r in rows) / len(rows)
    names = list(_parts(rows[0]))
    means = {n: sum(_parts(r).get(n, 0.0) for r in rows) / len(rows) for n in names}
    return [{"phase": n, "ms_per_step": 1e3 * s, "share": s / step} for n, s in means.items()]


def breakdown_figure(run_dir: str | Path):
    """A stacked bar per logged interval: each phase's seconds per step, up to the step time."""
    rows = profiled_rows(run_dir)
    parts = [_parts(r) for r in rows]
    fig, ax = plt.subplots(figsize=(7, 3.2))
    x = [str(r["step"]) for r in rows]
    bottom = [0.0] * len(rows)
    for name in parts[0]:
        ms = [1e3 * p.get(name, 0.0) for p in parts]
        ax.bar(x, ms, bottom=bottom, label=name)
        bottom = [b + h for b, h in zip(bottom, ms)]
    ax.set_xlabel("step (end of the logged interval)")
    ax.set_ylabel("ms per step")
    ax.set_title(f"where a step's time goes: {Path(run_dir).name}")
    ax.legend(fontsize=8, ncol=3)
    fig.tight_layout()
    return fig
