"""`canntrain overfit RECIPE [--samples 32] [--steps 200] [--set KEY=VALUE]...`: the cann-recipes-train articles'
first check when a model will not learn: trained on a few dozen samples again and again, it must drive its loss
near zero. If it does not, something between the data and the optimizer is broken (labels shifted against the
inputs, a mask that hides the answers, a detached graph, a learning rate of zero), not the amount of data.

The recipe's own model, data path, loss and optimizer run; only the data is cut to its first ``samples`` rows (the
stage's sampler draws from them, through the real loader), the schedule is constant after a short warm-up, and
weight decay is off. It passes when the last logged loss is under ``ratio`` (10 %) of the first.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from canntrain_core.errors import BadInput
from canntrain_core.recipe import load_recipe, parse_overrides
from canntrain_core.stages import make_trainer
from canntrain_core.train.metrics import read_metrics

ONLINE = ("grpo", "ppo")  # their loss is not a fit to fixed targets: no overfit check


@dataclass
class OverfitResult:
    run_dir: Path
    first: float  # the first logged training loss
    last: float  # and the last
    ratio: float  # the pass mark: last < ratio x first

    @property
    def passed(self) -> bool:
        return self.last < self.ratio * self.first

    def __str__(self) -> str:
        verdict = (
            "passed: the model, the loss and the data path can learn"
            if self.passed
            else "FAILED: the loss did not fall to near zero on a few samples; look for labels shifted against the "
            "inputs, a loss mask that hides what should be learned, a detached graph or a zero learning rate"
        )
        return f"overfit {verdict} (loss {self.first:.4f} -> {self.last:.4f}, pass under {self.ratio * self.first:.4f})"


def overfit_recipe(recipe_path, overrides=None, steps: int = 200):
    """The recipe (with ``overrides``) set for the check: ``steps`` steps, a constant schedule after a short
    warm-up, no weight decay, a log line every tenth of the steps."""
    keys = {
        **parse_overrides(overrides),
        "optim.max_steps": steps,
        "optim.epochs": None,
        "optim.scheduler": "constant",
        "optim.warmup_steps": min(10, steps // 10),
        "optim.warmup_ratio": None,
        "optim.weight_decay": 0.0,
        "logging.log_interval": max(1, steps // 10),
        "logging.eval_interval": steps,
        "logging.ckpt_interval": steps,
    }
    recipe = load_recipe(recipe_path, keys)
    if recipe.train_mode in ONLINE:
        raise BadInput(f"train_mode {recipe.train_mode}: no fixed targets to overfit; check its SFT start instead")
    return recipe


def overfit(recipe, samples: int = 32, run_dir=None, ratio: float = 0.1, trainer_class=None) -> OverfitResult:
    """Train ``recipe`` (see :func:`overfit_recipe`) on its first ``samples`` rows; ``trainer_class``: the stage's
    trainer unless given (a test hands a deliberately broken one)."""
    run_dir = Path(run_dir or f"runs/overfit-{time.strftime('%Y%m%d-%H%M%S')}")
    trainer = (trainer_class or make_trainer)(recipe, run_dir=run_dir, progress=False)
    sampler = trainer.data.sampler
    sampler.limit(max(samples, sampler.dp_size))  # its first rows, drawn again
    trainer.fit()
    losses = [r["loss"] for r in read_metrics(trainer.run_dir) if "loss" in r]
    return OverfitResult(trainer.run_dir, losses[0], losses[-1], ratio)
