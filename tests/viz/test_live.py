"""The live curves: the picture drawn from a run's rows, no figure left open, the throttle, and nothing attached
outside a Jupyter kernel."""

from __future__ import annotations

import matplotlib.pyplot as plt

from canntrain_core.train.metrics import MetricsLog
from canntrain_core.train.trainer import Trainer
from canntrain_core.viz import live
from canntrain_core.viz.live import LiveCurves, live_figure


def write_run(run_dir, steps: int = 10, sink=None) -> MetricsLog:
    """A run's metrics.jsonl as the trainer writes it: the step 0 evaluation, a row per step, an evaluation every 5."""
    log = MetricsLog(run_dir / "metrics.jsonl")
    if sink is not None:
        log.sinks.append(sink)
    log.write({"step": 0, "val_loss": 6.0, "val_ppl": 403.4})
    for s in range(1, steps + 1):
        row = {"step": s, "loss": 6.0 - 0.1 * s, "lr": 1e-3, "grad_norm": 1.0 / s, "tokens_per_second": 1000.0 + s}
        log.write({**row, **({"val_loss": 6.0 - 0.1 * s} if s % 5 == 0 else {}), "expert_tokens": [[1, 2]]})
    return log


def test_the_picture_has_a_panel_per_curve_and_validation_markers_on_the_loss(tmp_path):
    write_run(tmp_path, steps=10)
    fig = live_figure(tmp_path)
    try:
        assert [ax.get_title() for ax in fig.axes] == [live.TITLES[k] for k in live.PANELS]
        assert live.PANELS == ["loss", "lr", "grad_norm", "tokens_per_second"]
        train, val = fig.axes[0].get_lines()
        assert list(train.get_xdata()) == list(range(1, 11))
        assert list(val.get_xdata()) == [0, 5, 10] and list(val.get_ydata()) == [6.0, 5.5, 5.0]
        for ax in fig.axes[1:]:
            (line,) = ax.get_lines()
            assert len(line.get_xdata()) == 10
    finally:
        plt.close(fig)


def test_redraws_are_throttled_and_leave_no_figure_open(tmp_path, monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(live.time, "monotonic", lambda: clock[0])
    drawn = []

    class Recorded(LiveCurves):
        def draw(self):  # the real picture, minus the display: what it would show
            drawn.append(live_figure(self.run_dir).axes[0].get_lines()[0].get_xdata()[-1])
            plt.close("all")
            self.drawn_at, self.pending = clock[0], False

    sink = Recorded(tmp_path, max_steps=10, interval=2.0)

    def tick(record):  # one second per step
        clock[0] += 1.0
        sink(record)

    write_run(tmp_path, steps=10, sink=tick)
    assert drawn == [1, 3, 5, 7, 9, 10]  # every 2 s, and the last step
    assert not plt.get_fignums()


def test_a_held_back_picture_is_drawn_on_close_saved_and_its_figure_closed(tmp_path, capsys):
    curves = LiveCurves(tmp_path, interval=60)
    write_run(tmp_path, steps=3, sink=curves)  # drawn at step 1, steps 2 and 3 held back
    curves.close()
    assert (tmp_path / "plots" / "live.png").stat().st_size > 0
    # outside a kernel IPython's display prints what it would show; the path is the same otherwise
    assert capsys.readouterr().out.splitlines() == ["<IPython.core.display.Image object>"] * 2
    assert not curves.pending and not plt.get_fignums()


def test_outside_a_notebook_attaching_does_nothing(tmp_path, fast_recipe):
    trainer = Trainer(fast_recipe(**{"optim.max_steps": 2}), run_dir=tmp_path, progress=False)
    assert not live.in_notebook()
    assert LiveCurves.attach(trainer) is None and trainer.metrics.sinks == []
    trainer.fit()
    assert not (tmp_path / "plots").exists()
