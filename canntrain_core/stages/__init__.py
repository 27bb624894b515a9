"""The stage table: which trainer runs each ``train_mode``. The one place above the engine that names stages.

``pretrain`` is the engine's own :class:`~canntrain_core.train.trainer.Trainer`, ``sft`` adds its instruction
data (``stages/sft.py``); ``reward`` and ``dpo`` train on preference pairs (``stages/reward.py``,
``stages/dpo.py``, sharing ``stages/pairs.py``); ``grpo`` and ``ppo`` sample and score online
(``stages/grpo.py``, ``stages/ppo.py``, sharing ``stages/online.py`` and the frozen models of
``stages/frozen.py``). The engine (``train/``) knows none of them by name: the command line,
the layout runner and the notebooks build a run's trainer with :func:`make_trainer`.
"""

from __future__ import annotations

import os

from canntrain_core.recipe import Recipe
from canntrain_core.stages.grpo import GRPOTrainer
from canntrain_core.stages.dpo import DPOTrainer
from canntrain_core.stages.reward import RewardTrainer
from canntrain_core.stages.ppo import PPOTrainer, ScorerService
from canntrain_core.stages.sft import SFTTrainer
from canntrain_core.train.stage import check_stage
from canntrain_core.train.trainer import Trainer

STAGES: dict[str, type[Trainer]] = {
    "pretrain": Trainer,
    "sft": SFTTrainer,
    "reward": RewardTrainer,
    "dpo": DPOTrainer,
    "grpo": GRPOTrainer,
    "ppo": PPOTrainer,
}
for _mode, _stage in STAGES.items():  # the contract (train/stage.py), held at import rather than at step 1
    check_stage(_stage, Trainer)
    if _mode not in _stage.train_modes:
        raise TypeError(f"STAGES[{_mode!r}] is {_stage.__name__}, whose train_modes are {_stage.train_modes}")


def stage_of(recipe: Recipe) -> type[Trainer]:
    """The trainer class of the recipe's stage: what the memory tools and the command line ask about it."""
    return STAGES[recipe.train_mode]


def make_trainer(recipe: Recipe, **kwargs) -> Trainer | ScorerService:
    """The trainer of the recipe's stage (``kwargs``: the Trainer's run_dir, resume_from, accelerator, progress).

    A stage's extra ranks (PPO's separated placement, ``rlhf.device_placement: separated``), the ranks past
    ``distributed.world_size``, hold the reference and the reward model and serve the trainer's ranks
    (:class:`ScorerService`)."""
    stage = stage_of(recipe)
    if stage.extra_ranks(recipe) and int(os.environ.get("RANK", "0")) >= recipe.distributed.world_size:
        return ScorerService(recipe, **kwargs)
    return stage(recipe, **kwargs)
