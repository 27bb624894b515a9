"""Live curves of a run in the notebook cell that trains it: loss (validation loss as markers), learning rate,
gradient norm and throughput against step, redrawn in place as metrics.jsonl grows.

``LiveCurves.attach(trainer)`` before ``trainer.fit()``. The picture is an ``IPython.display`` output updated
through its display id, so JupyterLab redraws it and papermill records the last one; outside a Jupyter kernel
attaching does nothing."""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path
from typing import Any

from canntrain_core.train.metrics import read_metrics
from canntrain_core.viz.plots import curves_figure, save_png

PANELS = ["loss", "lr", "grad_norm", "tokens_per_second"]
TITLES = {
    "loss": "loss (o: validation)",
    "lr": "learning rate",
    "grad_norm": "gradient norm (before clipping)",
    "tokens_per_second": "tokens/s per device",
}


def live_figure(run_dir: str | Path):
    """``plots.curves_figure`` of ``run_dir``'s PANELS, one row of small panels, with the validation loss as
    markers on the training loss."""
    fig = curves_figure([run_dir], PANELS, labels=["train"], titles=TITLES)
    val = [(r["step"], r["val_loss"]) for r in read_metrics(run_dir) if "val_loss" in r]
    loss = fig.axes[0]
    if val:
        loss.plot(*zip(*val), "o", mfc="none", label="validation")
    loss.legend()
    for ax in fig.axes:
        ax.set_xlabel("step")
    fig.set_size_inches(12, 2.8)
    fig.tight_layout()
    return fig


def in_notebook() -> bool:
    """Running in a Jupyter kernel (JupyterLab, papermill, nbmake): where an output can be redrawn in place."""
    ipython = sys.modules.get("IPython")  # never imported: not IPython (and importing it would cost time)
    shell = ipython.get_ipython() if ipython is not None else None
    return getattr(shell, "kernel", None) is not None  # a terminal IPython has no kernel to redraw an output


class LiveCurves:
    """A ``MetricsLog`` sink that redraws ``live_figure`` of the run on each record with a training loss, at most
    once per ``interval`` seconds (drawing takes a few tenths of a second), and always at the last step
    (``max_steps``) or on ``close()``. Each picture is also plots/live.png in the run directory."""

    def __init__(self, run_dir: str | Path, max_steps: int | None = None, interval: float = 2.0):
        self.run_dir = Path(run_dir)
        self.max_steps = max_steps
        self.interval = interval
        self.handle = None  # the display's handle, after the first picture
        self.drawn_at = -math.inf
        self.pending = False  # a record came since the last picture

    @classmethod
    def attach(cls, trainer, interval: float = 2.0) -> LiveCurves | None:
        """Redraw ``trainer``'s curves as its ``metrics`` log is written (rank 0's), in a Jupyter kernel; anywhere
        else (a script, a terminal) attach nothing and return None."""
        if not in_notebook():
            return None
        live = cls(trainer.run_dir, trainer.recipe.optim.max_steps, interval)
        trainer.metrics.sinks.append(live)
        return live

    def __call__(self, record: dict[str, Any]) -> None:
        if "loss" not in record:  # the step 0 evaluation: nothing to draw yet
            return
        self.pending = True
        last = self.max_steps is not None and record["step"] >= self.max_steps
        if last or time.monotonic() - self.drawn_at >= self.interval:
            self.draw()

    def close(self) -> None:
        """Draw what the throttle held back (a run stopped before its last step, e.g. ``fit(stop_after=N)``)."""
        if self.pending:
            self.draw()

    def draw(self) -> None:
        # deferred: start-up time (IPython is imported already wherever this is attached, see in_notebook)
        from IPython.display import Image, display

        png = save_png(live_figure(self.run_dir), self.run_dir / "plots" / "live.png")  # closes the figure
        image = Image(filename=str(png))
        if self.handle is None:
            self.handle = display(image, display_id=True)
        else:
            self.handle.update(image)
        self.drawn_at = time.monotonic()  # from the end: drawing's own time does not count toward the interval
        self.pending = False
