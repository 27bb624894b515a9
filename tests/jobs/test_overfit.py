"""`canntrain overfit`: the tiny model drives its loss near zero on a few samples through the real data path; a data
path whose targets no longer line up with the inputs fails the check, and the command says so with exit code 1."""

from __future__ import annotations

import torch

from canntrain_core.cli import main
from canntrain_core.jobs.overfit import overfit, overfit_recipe
from canntrain_core.train.trainer import Trainer
from conftest import FAST, TINY


def test_the_tiny_model_overfits_a_few_samples(tmp_path, data_cache):
    recipe = overfit_recipe(TINY, {**FAST, "data.cache_dir": data_cache}, steps=100)
    result = overfit(recipe, samples=8, run_dir=tmp_path / "run")
    assert result.passed, str(result)
    assert result.last < 0.1 * result.first


class ShuffledTargets(Trainer):
    """A broken data path: each batch's targets are its inputs' next tokens in a fresh random order."""

    def _model_args(self, batch):
        x, t, extra = super()._model_args(batch)
        return x, t[:, torch.randperm(t.shape[1])], extra


def test_a_broken_data_path_fails_the_check(tmp_path, data_cache):
    recipe = overfit_recipe(TINY, {**FAST, "data.cache_dir": data_cache}, steps=100)
    result = overfit(recipe, samples=8, run_dir=tmp_path / "run", trainer_class=ShuffledTargets)
    assert not result.passed and "FAILED" in str(result)


def test_the_command_prints_the_verdict_and_exits_by_it(tmp_path, data_cache, capsys):
    sets = [a for k, v in {**FAST, "data.cache_dir": data_cache}.items() for a in ("--set", f"{k}={v}")]
    assert main(["overfit", str(TINY), *sets, "--samples", "8", "--steps", "100", "--run-dir", str(tmp_path)]) == 0
    assert "overfit passed" in capsys.readouterr().out
