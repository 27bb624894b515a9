"""Seeing a run: where a step's time goes (and that measuring it costs nothing when off), a profiler trace, the
policy for a NaN or inf step, gradient norm spikes, one progress line per log interval in a batch log, and
several runs' curves in one picture."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from canntrain_core.cli import main
from canntrain_core.errors import NonFinite
from canntrain_core.runtime.accelerator import Accelerator
from canntrain_core.train.metrics import read_metrics
from canntrain_core.train.progress import LogLines, progress_bar
from canntrain_core.train.trainer import Trainer
from conftest import FAST, TINY


def rows(run_dir):
    return [r for r in read_metrics(run_dir) if "loss" in r]


def test_the_breakdown_adds_up_to_the_step_and_costs_no_synchronisation_when_off(tmp_path, fast_recipe, monkeypatch):
    calls = []
    synchronize = Accelerator.synchronize
    monkeypatch.setattr(Accelerator, "synchronize", lambda self: calls.append(1) or synchronize(self))
    steps = {"optim.max_steps": 8, "logging.log_interval": 4, "logging.eval_interval": 6}  # 6: inside an interval
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
    said = r"step 3: the gradient norm is nan .*/step_2\. Lower optim\.lr .*and resume from it"
    with pytest.raises(NonFinite, match=said):
        NaNAtStep3(recipe, run_dir=tmp_path, progress=False).fit()
    assert [r["step"] for r in rows(tmp_path)] == [1, 2]  # what was written stays


def test_a_nan_step_is_skipped_and_counted_when_the_recipe_says_so(tmp_path, fast_recipe):
    recipe = fast_recipe(**{"optim.max_steps": 5, "logging.log_interval": 1, "optim.nonfinite": "skip"})
    trainer = NaNAtStep3(recipe, run_dir=tmp_path, progress=False)
    trainer.fit()
    assert [r.get("skipped_steps", 0) for r in rows(tmp_path)] == [0, 0, 1, 1, 1]
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())  # the NaN never reached a weight
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in rows(tmp_path))


def test_each_checkpoints_time_is_logged_with_the_next_row(tmp_path, fast_recipe):
    recipe = fast_recipe(**{"optim.max_steps": 6, "logging.ckpt_interval": 2, "logging.eval_interval": 100})
    Trainer(recipe, run_dir=tmp_path, progress=False).fit()
    logged = {r["step"]: r.get("checkpoint_seconds") for r in rows(tmp_path)}
    assert [s for s, t in logged.items() if t is not None] == [3, 5]  # the saves at 2 and 4 (6's: no row after)
    assert all(0 < t < 60 for t in logged.values() if t is not None)


def test_a_memory_budget_ends_the_run_with_the_out_of_memory_diagnosis(tmp_path, data_cache):
    """distributed.memory_budget_gb rehearses a smaller device: 5 MiB beyond what a fresh `canntrain train` held
    before its model was built (on a CPU, the process's data size limit; a process that ran before holds freed heap
    it may reuse, hence a new one here) is less than the tiny model's estimated 20 MiB, so step 1 fails as an
    out-of-memory would on a device: exit code 3, the estimate against the budget, the cheapest change."""
    sets = {**FAST, "data.cache_dir": data_cache, "distributed.memory_budget_gb": 5 / 1024}
    r = subprocess.run(
        [sys.executable, "-m", "canntrain_core.cli", "train", str(TINY), "--run-dir", str(tmp_path), "--no-progress"]
        + [a for k, v in sets.items() for a in ("--set", f"{k}={v}")],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=120,
    )
    assert r.returncode == 3, r.stderr[-2000:]
    said = r"(?s)canntrain train: step 1: .*allocate memory.*per device .* against 5\.0 MiB available"
    assert re.search(said, r.stderr)
    assert "No checkpoint was written yet." in r.stderr


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
    logged = rows(tmp_path)
    assert [r.get("grad_norm_spikes", 0) for r in logged] == [0, 1]
    assert logged[1]["grad_norm_spike_step"] == 8 and logged[1]["grad_norm_spike"] > 100 * logged[0]["grad_norm"]
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


def _fault(fault: str, tmp_path, data_cache, torchrun: tuple[str, ...] = (), **env):
    """tests/_fault_rank.py under torchrun (with ``torchrun``'s options) on 2 gloo ranks, rank 1 meeting ``fault``;
    (result, seconds)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[1]), "FAULT": fault, **env}
    started = time.monotonic()
    r = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *torchrun]
        + [str(Path(__file__).parents[1] / "_fault_rank.py"), str(tmp_path / "run"), data_cache],
        capture_output=True,
        text=True,
        env=env,
        timeout=180,
    )
    return r, time.monotonic() - started


@pytest.mark.slow
def test_a_hung_rank_is_named_with_the_collective_and_the_step(tmp_path, data_cache):
    """Rank 1 waits 60 s for step 3's batch; rank 0's collective gives up after distributed.timeout_seconds=5 and
    says which collective, over which group, where each rank was, and the checkpoint to resume from."""
    r, seconds = _fault("hang", tmp_path, data_cache)
    assert r.returncode != 0 and seconds < 55, r.stderr[-3000:]  # not the 60 s sleep
    line = next(x for x in r.stderr.splitlines() if x.startswith("canntrain train: rank 0:"))
    assert "did not finish within distributed.timeout_seconds=5 in step 3 (compute), after step 2 completed" in line
    assert "gloo:" in line and "ranks [0, 1]" in line  # the collective and its group, from the flight recorder
    assert "Not there yet: rank 1 at step 3 (data)" in line
    assert line.endswith(f"The last complete checkpoint is {tmp_path / 'run' / 'checkpoints' / 'step_2'}.")


@pytest.mark.slow
def test_a_killed_peer_is_one_line_on_the_survivor_naming_it(tmp_path, data_cache):
    """Rank 1 is SIGKILLed waiting for step 3's batch: the survivor's collective fails (gloo: the connection was
    closed or reset) and it says so in one line, naming the rank that never got there; no traceback."""
    # torchrun polls its ranks every 0.1 s and stops the survivor when it sees the dead one; on one busy host that can
    # come before the survivor's collective fails and it speaks (once in a suite run here). A node lost is seen by
    # its own agent, not the survivor's: polling every 5 s here leaves the survivor that time, as it would have.
    r, _ = _fault("kill", tmp_path, data_cache, torchrun=("--monitor-interval", "5"))
    assert r.returncode != 0
    line = next((x for x in r.stderr.splitlines() if x.startswith("canntrain train: rank 0:")), None)
    assert line, r.stderr[-3000:]
    assert "failed in step 3 (compute), after step 2 completed. Not there yet: rank 1 at step 3 (data)" in line
    assert line.endswith(f"The last complete checkpoint is {tmp_path / 'run' / 'checkpoints' / 'step_2'}.")
    assert "Traceback" not in r.stderr.split("canntrain train: rank 0:")[0][-2000:]  # rank 0 printed none


@pytest.mark.slow
def test_ranks_that_see_another_cann_stop_at_start_in_one_line(tmp_path, data_cache):
    """Rank 1 sees another CANN toolkit than rank 0: every rank stops before any work, naming the ranks."""
    other = tmp_path / "Ascend" / "ascend-toolkit" / "latest"
    other.mkdir(parents=True)
    (other / "ascend_toolkit_install.info").write_text("package_name=Ascend-cann-toolkit\nversion=8.0.RC1\n")
    r, _ = _fault("cann", tmp_path, data_cache, OTHER_CANN=str(other))
    assert r.returncode != 0
    said = "canntrain train: the ranks of this job disagree on CANN: rank 0 ("
    assert said in r.stderr, r.stderr[-3000:]  # every rank says it; torchrun may stop one before it prints
    line = said + r.stderr.split(said)[1]
    assert "): CANN not found; rank 1 (" in line and "): CANN 8.0.RC1. Every rank must see the same device" in line
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_dead_peer_under_a_checkpoint_is_a_collective_failure():
    """gloo says a dead peer's connection was reset (or closed); inside a save, torch wraps it in its
    CheckpointException, a BaseException: both are recognised, so the run ends with the one-line diagnosis."""
    import traceback

    from torch.distributed.checkpoint.api import CheckpointException

    from canntrain_core.runtime.watchdog import PHASES, Position, is_collective_failure

    reset = RuntimeError("[gloo/transport/tcp/pair.cc:534] Read error [127.0.0.1]:29500: Connection reset by peer")
    assert is_collective_failure(reset)
    wrapped = CheckpointException("save failed", {1: (reset, traceback.StackSummary())})
    assert is_collective_failure(wrapped)
    assert not is_collective_failure(CheckpointException("save failed", {0: (ValueError("bad"), None)}))
    # the checkpoint's own phase, after the step's evaluation: a rank saving is ahead of one still evaluating
    assert PHASES[-2:] == ("evaluate", "checkpoint")
    assert Position(3, "evaluate") < Position(3, "checkpoint") < Position(4, "data")
