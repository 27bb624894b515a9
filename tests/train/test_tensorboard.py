"""logging.trackers: [tensorboard]: metrics.jsonl's numbers as TensorBoard scalars, read back with TensorBoard's own
reader; a resumed run shows each step once; without the package the trainer stops at its start, naming the key."""

from __future__ import annotations

import shutil
import sys

import pytest

from canntrain_core.errors import RecipeError
from canntrain_core.train.metrics import read_metrics
from canntrain_core.train.trainer import Trainer

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402


def scalars(run_dir, tag: str) -> list[tuple[int, float]]:
    """(step, value) of every ``tag`` event TensorBoard shows for the run (events a resume purged left out)."""
    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})  # 0: keep them all
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars(tag)]


def logged(run_dir, key: str) -> list[tuple[int, float]]:
    return [(r["step"], r[key]) for r in read_metrics(run_dir) if key in r]


def assert_same(got: list[tuple[int, float]], want: list[tuple[int, float]]) -> None:
    """TensorBoard stores float32: equal steps, values within float32's rounding."""
    assert [s for s, _ in got] == [s for s, _ in want]
    assert [v for _, v in got] == pytest.approx([v for _, v in want], rel=1e-6)


def test_every_metric_is_a_scalar_at_its_step(tmp_path, fast_recipe):
    recipe = fast_recipe(**{"optim.max_steps": 6, "logging.eval_interval": 3, "logging.trackers": ["tensorboard"]})
    trainer = Trainer(recipe, run_dir=tmp_path, progress=False)
    trainer.fit()
    assert [sink.writer for sink in trainer.metrics.sinks] == [None]  # fit's end closed the writer
    assert_same(scalars(tmp_path, "loss"), logged(tmp_path, "loss"))
    assert [s for s, _ in logged(tmp_path, "loss")] == [1, 2, 3, 4, 5, 6]
    assert_same(scalars(tmp_path, "val_loss"), logged(tmp_path, "val_loss"))  # steps 0, 3, 6
    tags = set(EventAccumulator(str(tmp_path / "tensorboard")).Reload().Tags()["scalars"])
    assert {"lr", "grad_norm", "tokens_per_second", "val_ppl"} <= tags and "step" not in tags


def test_a_resumed_run_shows_each_step_once(tmp_path, fast_recipe):
    recipe = fast_recipe(**{"optim.max_steps": 12, "logging.trackers": ["tensorboard"]})  # checkpoints at 6 and 12
    Trainer(recipe, run_dir=tmp_path, progress=False).fit()
    shutil.rmtree(tmp_path / "checkpoints" / "step_12")  # as if killed after step 12's row, before its checkpoint
    Trainer(recipe, run_dir=tmp_path, resume_from="auto", progress=False).fit()  # rewrites steps 7-12
    assert [s for s, _ in logged(tmp_path, "loss")] == list(range(1, 13))
    assert_same(scalars(tmp_path, "loss"), logged(tmp_path, "loss"))  # not 7-12 twice
    assert len(list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))) == 2  # the first run's file stays


def test_without_the_package_the_trainer_stops_at_its_start_naming_the_key(tmp_path, fast_recipe, monkeypatch):
    for name in ("tensorboard", "torch.utils.tensorboard"):  # as if tensorboard were not installed
        monkeypatch.setitem(sys.modules, name, None)
    recipe = fast_recipe(**{"logging.trackers": ["tensorboard"]})
    with pytest.raises(RecipeError, match=r"logging\.trackers: tensorboard needs the tensorboard package.*pip install"):
        Trainer(recipe, run_dir=tmp_path, progress=False)
    assert not (tmp_path / "metrics.jsonl").exists()
