"""Faults of the file system, made for real: a small tmpfs that fills up during a checkpoint, and a read-only one
under the run directory. Each is one line and its exit code, and nothing already written is lost. Mounting needs
root (or CAP_SYS_ADMIN); where the machine refuses, these tests skip."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from canntrain_core.checkpoint.dcp import verify_checkpoint
from canntrain_core.cli import main
from canntrain_core.train.metrics import read_metrics
from conftest import FAST, TINY


@pytest.fixture
def mount(tmp_path):
    """mount(options) -> a fresh tmpfs directory (unmounted after the test), or the test skips."""
    mounted: list[Path] = []

    def make(options: str) -> Path:
        where = tmp_path / f"fs{len(mounted)}"
        where.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], capture_output=True)
        if done.returncode:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
        mounted.append(where)
        return where

    yield make
    for where in mounted:
        subprocess.run(["umount", str(where)], capture_output=True)


def _train(run_dir: Path, data_cache: str, **keys) -> list[str]:
    sets = {**FAST, "data.source": "stdlib", "data.cache_dir": data_cache, **keys}
    args = ["train", str(TINY), "--run-dir", str(run_dir), "--no-progress"]
    for k, v in sets.items():
        args += ["--set", f"{k}={v}"]
    return args


def test_a_full_disk_during_a_checkpoint_is_one_line_and_keeps_the_last_checkpoint(mount, data_cache, capfd):
    # room for the run's small files and one checkpoint of this tiny model (11.4 MB), not for a second one
    run = mount("size=16m") / "run"
    rc = main(_train(run, data_cache, **{"optim.max_steps": 6, "logging.ckpt_interval": 3, "logging.keep_last": 3}))
    err = capfd.readouterr().err
    assert rc == 1, err
    assert err.startswith("canntrain train: checkpoint step_6 could not be written under ") and err.count("\n") == 1
    assert "the disk is full (ENOSPC)" in err and "resume with --resume-from auto" in err
    ckpts = run / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_3"]  # the half-written step_6 is gone
    verify_checkpoint(ckpts / "step_3")  # and what was written before is whole
    assert [r["step"] for r in read_metrics(run) if "loss" in r] == list(range(1, 7))


def test_a_read_only_run_directory_is_refused_before_any_work(mount, data_cache, capfd):
    run = mount("ro,size=1m") / "run"
    rc = main(_train(run, data_cache))
    err = capfd.readouterr().err
    assert rc == 2, err
    assert (
        err == f"canntrain train: run directory {run}: {run.parent} cannot be written (a read-only file system); "
        "choose another --run-dir\n"
    )


@pytest.mark.parametrize("keep_last", [2, 5])
def test_what_killed_saves_and_prunings_left_is_cleaned_at_the_next_start(fast_recipe, tmp_path, capsys, keep_last):
    """A save killed before its rename leaves .tmp-step_N-*; a pruning killed inside rmtree (before pruning renamed
    first) left a step_N without its manifest, older than the newest checkpoint, that nothing saw again."""
    from canntrain_core.train.trainer import Trainer

    recipe = fast_recipe(**{"optim.max_steps": 3, "logging.ckpt_interval": 1, "logging.keep_last": keep_last})
    Trainer(recipe, run_dir=tmp_path, progress=False).fit()
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == (
        ["step_2", "step_3"] if keep_last == 2 else ["step_1", "step_2", "step_3"]
    )
    orphan = root / ".tmp-step_6-k1ll3d"
    orphan.mkdir()
    (orphan / "__0_0.distcp").write_bytes(b"\0" * 4096)
    half = root / "step_1"
    half.mkdir(exist_ok=True)
    (half / "manifest.json").unlink(missing_ok=True)
    (half / "__1_0.distcp").write_bytes(b"\0" * 4096)
    capsys.readouterr()
    resumed = Trainer(recipe, run_dir=tmp_path, resume_from="auto", progress=False)
    said = capsys.readouterr().out
    assert resumed.step == 3 and not orphan.exists() and not half.exists()
    assert "checkpoints: removed .tmp-step_6-k1ll3d (a save or pruning that was interrupted)" in said
    if keep_last == 2:
        assert "checkpoints: removed step_1 (no manifest: a pruning under logging.keep_last was interrupted)" in said
        assert sorted(p.name for p in root.iterdir()) == ["step_2", "step_3"]
    else:  # keep_last would not have pruned it yet: never deleted, set aside
        assert "checkpoints: set step_1 aside as step_1.damaged-" in said
        assert [p.name for p in root.iterdir() if p.name.startswith("step_1.damaged-")]
