"""Seeing a run: where a step's time goes (and that measuring it costs nothing when off), a profiler trace, the
policy for a NaN or inf step, gradient norm spikes, one progress line per log interval in a batch log, and
several runs' curves in one picture."""

from __future__ import annotations

import io
import json

import pytest
import torch

from canntrain_core.cli import main
from canntrain_core.errors import NonFinite
from canntrain_core.runtime.accelerator import Accelerator
from canntrain_core.train.metrics import read_metrics
from canntrain_core.train.progress import LogLines, progress_bar
from canntrain_core.train.trainer import Trainer


def rows(run_dir):
    return [r for r in read_metrics(run_dir) if "loss" in r]


def test_the_breakdown_adds_up_to_the_step_and_costs_no_synchronisation_when_off(tmp_path, fast_recipe, monkeypatch):
    calls = []
    synchronize = Accelerator.synchronize
    monkeypatch.setattr(Accelerator, "synchronize", lambda self: calls.append(1) or synchronize(self))
    steps = {"optim.max_steps": 8, "logging.log_interval": 4, "logging.eval_interval": 100}
    Trainer(fast_recipe(**steps), run_dir=tmp_path / "off", progress=False).fit()
    off = len(calls)
    assert off == 2  # one per logged row (the throughput's clock), nothing per step
    assert not any(k.startswith("time/") for r in rows(tmp_path / "off") for k in r)
    calls.clear()
    Trainer(fast_recipe(**steps, **{"logging.profile.enabled": True}), run_dir=tmp_path / "on", progress=False).fit()
    assert len(calls) == off + 8 * 4  # data, forward, backward, optimizer: one each per step
    for r in rows(tmp_path / "on"):
        parts = sum(r[f"time/{p}"] for p in ("data", "forward", "backward", "optimizer"))
        assert 0.8 * r["step_time"] <= parts <= r["step_time"], r  # the rest: the schedule, the bar, the log


def test_a_trace_of_the_profiled_steps_is_written_per_rank(tmp_path, fast_recipe):
    recipe = fast_recipe(**{"optim.max_steps": 4, "logging.profile.trace": True, "logging.profile.steps": [2, 3]})
    Trainer(recipe, run_dir=tmp_path, progress=False).fit()
    (trace,) = (tmp_path / "profile").glob("rank0*.pt.trace.json")
    events = json.loads(trace.read_text())["traceEvents"]
    assert any("aten::mm" in e.get("name", "") for e in events)  # the steps' matmuls, on the CPU here


class NaNAtStep3(Trainer):
    """The real loop, with one gradient made NaN at step 3 (what a diverging run or a bad batch does)."""

    def train_step(self, micro_batches):
        loss = super().train_step(micro_batches)
        if self.step + 1 == 3:
            next(p for p in self.model.parameters() if p.grad is not None).grad.fill_(float("nan"))
        return loss


def test_a_nan_step_stops_the_run_naming_the_last_checkpoint(tmp_path, fast_recipe):
    recipe = fast_recipe(**{"optim.max_steps": 6, "logging.ckpt_interval": 2, "logging.log_interval": 1})
    with pytest.raises(NonFinite, match=r"step 3: the gradient norm is nan .*/checkpoints/step_2\. Resume"):
        NaNAtStep3(recipe, run_dir=tmp_path, progress=False).fit()
    assert [r["step"] for r in rows(tmp_path)] == [1, 2]  # what was written stays


def test_a_nan_step_is_skipped_and_counted_when_the_recipe_says_so(tmp_path, fast_recipe):
    recipe = fast_recipe(**{"optim.max_steps": 5, "logging.log_interval": 1, "optim.nonfinite": "skip"})
    trainer = NaNAtStep3(recipe, run_dir=tmp_path, progress=False)
    trainer.fit()
    assert [r.get("skipped_steps", 0) for r in rows(tmp_path)] == [0, 0, 1, 1, 1]
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())  # the NaN never reached a weight
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in rows(tmp_path))


def test_a_gradient_norm_spike_is_reported(tmp_path, fast_recipe, capsys):
    class Spike(Trainer):
        def train_step(self, micro_batches):
            loss = super().train_step(micro_batches)
            if self.step + 1 == 8:
                for p in self.model.parameters():
                    p.grad.mul_(1000.0)
            return loss

    recipe = fast_recipe(**{"optim.max_steps": 8, "logging.log_interval": 4, "optim.grad_clip": None})
    Spike(recipe, run_dir=tmp_path, progress=False).fit()
    assert [r.get("grad_norm_spikes", 0) for r in rows(tmp_path)] == [0, 1]
    assert "step 8: gradient norm" in capsys.readouterr().err


def test_a_batch_log_gets_one_line_per_log_interval(tmp_path, fast_recipe, capsys):
    recipe = fast_recipe(**{"optim.max_steps": 6, "logging.log_interval": 2})
    Trainer(recipe, run_dir=tmp_path, progress=True).fit()  # stderr is not a terminal here, as under torchrun
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if ": step " in line]
    assert [line.split(": step ")[1].split()[0] for line in lines] == ["2/6", "4/6", "6/6"]
    assert all(" loss " in line and " left 0:" in line for line in lines) and "\r" not in err


def test_a_terminal_gets_the_bar():
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    assert not isinstance(progress_bar(10, 0, "run", True, Terminal()), LogLines)
    assert isinstance(progress_bar(10, 0, "run", True, io.StringIO()), LogLines)


def test_canntrain_plot_overlays_the_runs_curves(tmp_path):
    for name, scale in (("a", 1.0), ("b", 2.0)):
        run = tmp_path / name
        run.mkdir()
        lines = [{"step": s, "loss": scale / s, "lr": 1e-3, "grad_norm": 1.0} for s in (1, 2, 3)]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    out = tmp_path / "curves.png"
    assert (
        main(["plot", str(tmp_path / "a"), str(tmp_path / "b"), "--keys", "loss,lr,val_loss", "--out", str(out)]) == 0
    )
    assert out.stat().st_size > 0
    from canntrain_core.viz.plots import curves_figure

    fig = curves_figure([tmp_path / "a", tmp_path / "b"], ["loss", "lr"])
    assert [len(ax.lines) for ax in fig.axes] == [2, 2]
