"""Pictures of estimates for the notebook: a stacked bar per category, and slider controls.

The controls use ipywidgets when a notebook front-end is there to drive them; run headless
(papermill, nbmake) the chart is drawn once with the default values, so the same cell works in both.
"""

from __future__ import annotations

from typing import Sequence

import matplotlib.pyplot as plt
from IPython.display import display

from canntrain_core.sizing.estimator import CATEGORIES, GiB, MemoryEstimate, estimate
from canntrain_core.sizing.setup import TrainSetup
from canntrain_core.sizing.shapes import ModelShape

COLORS = dict(
    zip(CATEGORIES, ["#4c72b0", "#55a868", "#c44e52", "#e9a3a3", "#8172b2", "#b3a6dd", "#ccb974", "#64b5cd", "#bbbbbb"])
)


def stacked_bars(
    estimates: Sequence[tuple[str, MemoryEstimate]],
    capacity: float | None = None,
    ax=None,
    title: str = "per-device memory at the peak",
):
    """One stacked bar (GiB by category) per labelled estimate; a dashed line at ``capacity`` bytes."""
    if ax is None:
        _, ax = plt.subplots(figsize=(1.8 + 1.6 * len(estimates), 4))
    labels = [lab for lab, _ in estimates]
    bottoms = [0.0] * len(estimates)
    for cat in CATEGORIES:
        vals = [e.categories[cat] / GiB for _, e in estimates]
        if not any(vals):
            continue
        ax.bar(labels, vals, bottom=bottoms, label=cat.replace("_", " "), color=COLORS[cat])
        bottoms = [b + v for b, v in zip(bottoms, vals)]
    if capacity:
        ax.axhline(capacity / GiB, ls="--", color="k", lw=1)
        ax.text(len(labels) - 0.5, capacity / GiB, f" {capacity / GiB:.0f} GiB", va="bottom", ha="right")
    ax.set_ylabel("GiB")
    ax.set_title(title)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return ax


def controls(shape: ModelShape, base: TrainSetup, capacity: float | None = None) -> None:
    """Sliders for micro-batch, seq_length, TP, PP and recompute that redraw the chart.

    Draws the default chart straight away (that is what a headless run keeps), then shows the sliders when
    ipywidgets is installed; moving them redraws that same chart in place (one chart, never a second copy).
    """

    def figure(micro_batch: int, seq_length: int, tp: int, pp: int, recompute: str):
        try:
            s = base.but(micro_batch=micro_batch, seq_length=seq_length, tp=tp, pp=pp, recompute=recompute)
            est = estimate(shape, s)
        except ValueError as e:
            return f"not a valid layout: {e}"
        ax = stacked_bars(
            [(f"tp{tp} pp{pp}\nmb{micro_batch} s{seq_length}\n{recompute}", est)],
            capacity,
            title=f"{est.total / GiB:.1f} GiB at the peak ({est.phase}, {est.stage} stage)",
        )
        plt.close(ax.figure)  # shown through the display below, not again by the inline backend
        return ax.figure

    defaults = dict(
        micro_batch=base.micro_batch, seq_length=base.seq_length, tp=base.tp, pp=base.pp, recompute=base.recompute
    )
    chart = display(figure(**defaults), display_id=True)
    try:
        # deferred: optional here (without ipywidgets the chart is still drawn, without its sliders)
        import ipywidgets as w
    except ImportError:
        return
    ui = w.interactive(
        lambda **values: chart.update(figure(**values)),
        micro_batch=w.IntSlider(value=base.micro_batch, min=1, max=16),
        seq_length=w.SelectionSlider(options=[512, 1024, 2048, 4096, 8192, 16384], value=base.seq_length),
        tp=w.SelectionSlider(options=[1, 2, 4, 8], value=base.tp),
        pp=w.SelectionSlider(options=[1, 2, 4, 8, 16], value=base.pp),
        recompute=w.ToggleButtons(options=["none", "selective", "full"], value=base.recompute),
    )
    display(ui)
