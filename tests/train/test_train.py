"""Trainer behaviour: bit-exact resume, run-directory safety, checkpoint integrity, schedule."""

import math
import subprocess
import sys

import pytest
import torch

from canntrain_core.checkpoint import (
    CheckpointError,
    find_resumable,
    latest_checkpoint,
    list_checkpoints,
    verify_checkpoint,
)
from canntrain_core.recipe import RecipeError
from canntrain_core.train.metrics import read_metrics
from canntrain_core.train.optim import lr_factor
from canntrain_core.train.trainer import RunDirError, Trainer

from conftest import FAST, ROOT, TINY


def losses(run_dir):
    return {r["step"]: r["loss"] for r in read_metrics(run_dir) if "loss" in r}


@pytest.mark.parametrize(
    "extra",
    [
        {},
        # accumulation, worker processes that prefetch ahead of the trainer, and bf16 autocast
        {
            "optim.grad_accum_steps": 2,
            "data.num_workers": 2,
            "data.persistent_workers": True,
            "model.precision": "bf16",
        },
    ],
    ids=["plain", "accum2-workers2-bf16"],
)
def test_resume_is_bit_exact(tmp_path, fast_recipe, extra):
    recipe = fast_recipe(**extra)
    Trainer(recipe, run_dir=tmp_path / "full", progress=False).fit()
    Trainer(recipe, run_dir=tmp_path / "cut", progress=False).fit(stop_after=5)
    resumed = Trainer(recipe, run_dir=tmp_path / "cut", resume_from="auto", progress=False)
    assert resumed.step == 5
    resumed.fit()
    full, cut = losses(tmp_path / "full"), losses(tmp_path / "cut")
    assert sorted(full) == sorted(cut) == list(range(1, 13))
    assert all(full[s] == cut[s] for s in full), {s: (full[s], cut[s]) for s in full if full[s] != cut[s]}
    # The resumed run's metrics hold each step once, with validation at 0, 6 and 12.
    assert [r["step"] for r in read_metrics(tmp_path / "cut") if "val_loss" in r] == [0, 6, 12]


def test_loss_falls_and_run_dir_is_never_overwritten(tmp_path, fast_recipe):
    recipe = fast_recipe(
        **{"optim.max_steps": 30, "logging.eval_interval": 30, "logging.ckpt_interval": 10, "logging.keep_last": 2}
    )
    result = Trainer(recipe, run_dir=tmp_path, progress=False).fit()
    vals = [r["val_loss"] for r in read_metrics(tmp_path) if "val_loss" in r]
    assert vals[0] > math.log(512) - 0.5  # untrained: about ln(vocab)
    assert vals[-1] < vals[0] - 0.5, vals  # measured here: 6.28 -> 5.41 after 30 steps
    assert [p.name for p in result.checkpoints] == ["step_20", "step_30"]  # keep_last 2
    assert not (tmp_path / "plots").exists()  # the trainer draws nothing; the CLI and notebooks do
    before = (tmp_path / "metrics.jsonl").read_bytes()
    with pytest.raises(RunDirError, match="resume-from auto"):
        Trainer(recipe, run_dir=tmp_path, progress=False)
    assert (tmp_path / "metrics.jsonl").read_bytes() == before


def test_half_written_and_corrupt_checkpoints(tmp_path, fast_recipe):
    recipe = fast_recipe(**{"optim.max_steps": 6, "logging.ckpt_interval": 3})
    Trainer(recipe, run_dir=tmp_path, progress=False).fit()
    root = tmp_path / "checkpoints"
    assert [p.name for p in list_checkpoints(root)] == ["step_3", "step_6"]

    # A save that died before its manifest: a step directory with data but no manifest.
    half = root / "step_9"
    half.mkdir()
    (half / "__0_0.distcp").write_bytes(b"partial")
    assert latest_checkpoint(root) == root / "step_6"
    path, damaged = find_resumable(root)
    assert path == root / "step_6" and [(p, "incomplete checkpoint" in str(e)) for p, e in damaged] == [(half, True)]
    half.rename(tmp_path / "step_9")  # out of the way for the rest

    # A flipped byte in the newest good checkpoint: named, and auto falls back to step_3.
    shard = next((root / "step_6").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=rf"{shard.name} is corrupt"):
        verify_checkpoint(root / "step_6")
    with pytest.raises(CheckpointError, match="corrupt"):
        Trainer(recipe, run_dir=tmp_path / "other", resume_from=root / "step_6", progress=False)
    trainer = Trainer(recipe, run_dir=tmp_path, resume_from="auto", progress=False)
    assert trainer.step == 3


def test_schedule_warmup_cosine_floor(fast_recipe):
    cfg = fast_recipe(**{"optim.max_steps": 100, "optim.warmup_steps": 10, "optim.min_lr_ratio": 0.1}).optim
    assert lr_factor(0, cfg) == pytest.approx(0.1)
    assert lr_factor(9, cfg) == pytest.approx(1.0)
    assert lr_factor(10, cfg) == pytest.approx(1.0)
    assert lr_factor(55, cfg) == pytest.approx(0.55)  # halfway down the cosine: (1 + 0.1) / 2
    assert lr_factor(100, cfg) == pytest.approx(0.1)
    factors = [lr_factor(s, cfg) for s in range(10, 101)]
    assert all(a >= b for a, b in zip(factors, factors[1:]))


@pytest.mark.slow  # three runs of the command (12 steps)
def test_cli_train_resume_appends_metrics(tmp_path, data_cache, capfd):
    """`canntrain train` as the command line runs it (in this process: tests/train's killed-process test runs the
    command in its own): an existing run is refused, --resume-from auto continues it, a bad key is one line."""
    from canntrain_core.cli import main

    common = ["train", str(TINY), "--run-dir", str(tmp_path), "--no-progress"]
    for key, value in {
        "data.max_bytes": 300000,
        "data.tokenizer.vocab_size": 512,
        "data.cache_dir": data_cache,
        "data.seq_length": 64,
        "logging.log_interval": 1,
        "logging.ckpt_interval": 4,
    }.items():
        common += ["--set", f"{key}={value}"]
    assert main(common + ["--set", "optim.max_steps=4"]) == 0, capfd.readouterr().err[-2000:]
    capfd.readouterr()
    assert main(common + ["--set", "optim.max_steps=8"]) == 2
    refused = capfd.readouterr().err
    assert "already holds an earlier run (step_4)" in refused and "Traceback" not in refused
    assert main(common + ["--set", "optim.max_steps=8", "--resume-from", "auto"]) == 0
    again = capfd.readouterr().out
    assert "resumed from" in again and "step_4" in again
    assert sorted(losses(tmp_path)) == list(range(1, 9))
    assert (tmp_path / "plots" / "loss.png").stat().st_size > 0  # drawn by the CLI from metrics.jsonl
    assert main(common[:2] + ["--set", "optim.lrr=1"]) == 2
    assert "optim.lrr: unknown key" in capfd.readouterr().err


def test_out_of_memory_names_estimate_and_fix_and_keeps_checkpoint(tmp_path, fast_recipe):
    # The device cannot be made to run out of memory here, so the decoder raises what CUDA raises.
    from canntrain_core.train.trainer import OutOfMemory

    recipe = fast_recipe(**{"optim.max_steps": 8, "logging.ckpt_interval": 3})
    trainer = Trainer(recipe, run_dir=tmp_path, progress=False)

    def explode(module, args):
        if trainer.step == 4 and module.training:  # the forward of step 5
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    trainer.model.model.layers[0].register_forward_pre_hook(explode)
    with pytest.raises(OutOfMemory) as e:
        trainer.fit()
    msg = str(e.value)
    assert "step 5" in msg and "the estimate for this recipe is" in msg and "try: --set" in msg
    assert msg.endswith(f"The last complete checkpoint is {tmp_path / 'checkpoints' / 'step_3'}.")
    verify_checkpoint(tmp_path / "checkpoints" / "step_3")


@pytest.mark.slow  # training processes, one killed
def test_killed_process_resumes_to_the_same_losses(tmp_path, fast_recipe, data_cache):
    """SIGKILL a real `canntrain train` mid-run; `--resume-from auto` must finish the same curve."""
    import signal
    import time

    # killed once its step_8 checkpoint is there (polled every 20 ms), well before step 40's
    steps = {"optim.max_steps": 40, "logging.ckpt_interval": 4, "logging.eval_interval": 20}
    Trainer(fast_recipe(**steps), run_dir=tmp_path / "reference", progress=False).fit()

    run_dir = tmp_path / "killed"
    cmd = [sys.executable, "-m", "canntrain_core.cli", "train", str(TINY), "--run-dir", str(run_dir), "--no-progress"]
    for key, value in {**FAST, **steps, "data.cache_dir": data_cache}.items():
        cmd += ["--set", f"{key}={value}"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while not [p for p in list_checkpoints(run_dir / "checkpoints") if int(p.name[5:]) >= 8]:
        assert proc.poll() is None and time.time() < deadline, "the run ended before its step_8 checkpoint"
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (run_dir / "checkpoints" / "step_40").exists(), "killed too late to test anything"

    resumed = subprocess.run(cmd + ["--resume-from", "auto"], cwd=ROOT, capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    want, got = losses(tmp_path / "reference"), losses(run_dir)
    assert sorted(got) == list(range(1, 41))
    assert all(got[s] == want[s] for s in want), {s: (got[s], want[s]) for s in want if got[s] != want[s]}


def test_torn_last_metrics_line_is_dropped(tmp_path):
    from canntrain_core.train.metrics import MetricsLog

    log = MetricsLog(tmp_path / "metrics.jsonl")
    for step in (1, 2, 3):
        log.write({"step": step, "loss": 1.0 / step})
    with log.path.open("a") as f:
        f.write('{"step": 4, "lo')  # killed mid-write
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]
    log.truncate_after(2)
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]
    log.path.write_text('{"step": 1}\n{"ste\n{"step": 3}\n')  # damage in the middle is not a torn tail
    with pytest.raises(ValueError):
        read_metrics(tmp_path)


def test_cli_bad_data_source_is_one_clear_line(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "canntrain_core.cli",
            "train",
            str(TINY),
            "--run-dir",
            str(tmp_path),
            "--set",
            f"data.source={tmp_path / 'missing'}",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith("canntrain train: data.source") and "does not exist" in proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr


def _damage(ckpt, how: str) -> None:
    if how == "manifest-missing":
        (ckpt / "manifest.json").unlink()
    elif how == "shard-truncated":
        shard = next(ckpt.glob("*.distcp"))
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    else:  # another run's trainer state dropped in: same name and size, other bytes
        state = ckpt / "trainer_state_rank0.pt"
        data = bytearray(state.read_bytes())
        data[-100] ^= 0xFF
        state.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def every_3_steps(tmp_path_factory, data_cache):
    """A 12-step reference run and the recipe, checkpointing every 3 steps."""
    from canntrain_core.recipe import load_recipe

    recipe = load_recipe(TINY, {**FAST, "data.cache_dir": data_cache, "logging.ckpt_interval": 3})
    ref = tmp_path_factory.mktemp("ref")
    Trainer(recipe, run_dir=ref, progress=False).fit()
    return recipe, losses(ref)


@pytest.mark.parametrize("how", ["manifest-missing", "shard-truncated", "trainer-state-replaced"])
def test_damaged_newest_checkpoint_is_set_aside_and_the_run_trains_past_it(tmp_path, every_3_steps, how, capsys):
    recipe, want = every_3_steps
    Trainer(recipe, run_dir=tmp_path, progress=False).fit(stop_after=9)
    root = tmp_path / "checkpoints"
    _damage(root / "step_9", how)
    capsys.readouterr()
    trainer = Trainer(recipe, run_dir=tmp_path, resume_from="auto", progress=False)
    assert trainer.step == 6
    out = capsys.readouterr().out
    aside = [p for p in root.iterdir() if p.name.startswith("step_9.damaged-")]
    assert len(aside) == 1 and "step_9 is damaged" in out and f"moved it aside to {aside[0].name}" in out
    trainer.fit()
    got = losses(tmp_path)
    assert sorted(got) == list(range(1, 13))
    assert all(got[s] == want[s] for s in want), {s: (got[s], want[s]) for s in want if got[s] != want[s]}
    # keep_last 3 counted the fresh step_9, never the damaged one, which is still there
    assert [p.name for p in list_checkpoints(root)] == ["step_6", "step_9", "step_12"]
    assert aside[0].is_dir() and latest_checkpoint(root) == root / "step_12"
    # An explicit resume from the damaged directory stays an error naming it
    with pytest.raises(CheckpointError, match=aside[0].name):
        Trainer(recipe, run_dir=tmp_path / "again", resume_from=aside[0], progress=False)


def test_recipe_drift_is_named_on_resume_and_a_new_shape_is_refused(tmp_path, fast_recipe, capsys):
    recipe = fast_recipe(**{"logging.ckpt_interval": 3})
    Trainer(recipe, run_dir=tmp_path, progress=False).fit(stop_after=6)
    root = tmp_path / "checkpoints"
    _damage(root / "step_6", "manifest-missing")
    before = sorted(p.name for p in root.iterdir())
    with pytest.raises(RecipeError, match=r"model\.overrides\.num_hidden_layers: \(not set\) -> 2"):
        Trainer(
            fast_recipe(**{"model.overrides.num_hidden_layers": 2}),
            run_dir=tmp_path,
            resume_from="auto",
            progress=False,
        )
    with pytest.raises(RecipeError, match=r"model\.preset: 'tiny' -> 'llama2-7b'"):
        Trainer(fast_recipe(**{"model.preset": "llama2-7b"}), run_dir=tmp_path, resume_from="auto", progress=False)
    assert sorted(p.name for p in root.iterdir()) == before  # nothing touched, the damaged one not even moved

    capsys.readouterr()
    changed = fast_recipe(
        **{"optim.lr": 1e-4, "optim.max_steps": 20, "logging.log_interval": 5, "distributed.timeout_seconds": 60}
    )
    Trainer(changed, run_dir=tmp_path, resume_from="auto", progress=False)
    out = capsys.readouterr().out
    assert f"optim.lr: {recipe.optim.lr} -> 0.0001" in out
    assert "max_steps" not in out and "log_interval" not in out and "timeout_seconds" not in out


def test_val_fraction_0_trains_without_evaluation(tmp_path, fast_recipe):
    """data.val_fraction 0 holds out nothing: the run trains and logs no validation metrics."""
    result = Trainer(
        fast_recipe(**{"data.val_fraction": 0.0, "optim.max_steps": 6}), run_dir=tmp_path / "run", progress=False
    ).fit()
    rows = read_metrics(tmp_path / "run")
    assert result.step == 6 and result.val_loss is None
    assert [r["step"] for r in rows if "loss" in r] == list(range(1, 7))
    assert not any("val_loss" in r for r in rows)


def test_the_trainer_does_not_change_the_callers_recipe(tmp_path, fast_recipe):
    recipe = fast_recipe(**{"optim.epochs": 0.01, "optim.max_steps": 1000})
    before = recipe.to_yaml()
    trainer = Trainer(recipe, run_dir=tmp_path / "run", progress=False)
    assert trainer.recipe.optim.max_steps != 1000  # the epochs' steps, in the trainer's own copy
    assert recipe.to_yaml() == before


def test_a_users_callback_sees_every_point_of_the_loop_in_order(tmp_path, fast_recipe):
    """train/callbacks.py: on_fit_start once, before_step / after_iteration / after_step per step (the row made by
    then), on_fit_end once, also when a step fails."""
    from canntrain_core.train.callbacks import Callback

    class Recorder(Callback):
        def __init__(self):
            self.seen = []

        def on_fit_start(self, trainer):
            self.seen.append(("start", trainer.step))

        def before_step(self, trainer, step):
            self.seen.append(("before", step))

        def after_iteration(self, trainer, step):
            self.seen.append(("iteration", step))

        def after_step(self, trainer, raw, record):
            self.seen.append(("after", trainer.step, "loss" in record))

        def on_fit_end(self, trainer):
            self.seen.append(("end", trainer.step))

    recorder = Recorder()
    recipe = fast_recipe(**{"optim.max_steps": 2, "logging.log_interval": 2})
    Trainer(recipe, run_dir=tmp_path / "a", progress=False, callbacks=[recorder]).fit()
    assert recorder.seen == [
        ("start", 0),
        ("before", 1),
        ("iteration", 1),
        ("after", 1, False),
        ("before", 2),
        ("iteration", 2),
        ("after", 2, True),
        ("end", 2),
    ]

    class Fails(Recorder):
        def after_iteration(self, trainer, step):
            raise RuntimeError("stop here")

    failing = Fails()
    with pytest.raises(RuntimeError, match="stop here"):
        Trainer(recipe, run_dir=tmp_path / "b", progress=False, callbacks=[failing]).fit()
    assert failing.seen[-1] == ("end", 0)
