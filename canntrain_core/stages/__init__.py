"""The stage table: which trainer runs each ``train_mode``. The one place above the engine that names stages.

``pretrain`` is the engine's own :class:`~canntrain_core.train.trainer.Trainer`, ``sft`` adds its instruction
data (``stages/sft.py``); ``reward`` and
``dpo`` train on preference pairs (``rlhf/pairs.py``); ``grpo`` and ``ppo`` sample and score online
(``rlhf/grpo.py``, ``rlhf/ppo.py``). The engine (``train/``) knows none of them by name: the command line,
the layout runner and the notebooks build a run's trainer with :func:`make_trainer`.
"""

from __future__ import annotations

import os

from canntrain_core.recipe import Recipe
from canntrain_core.rlhf.grpo import GRPOTrainer
from canntrain_core.rlhf.pairs import DPOTrainer, RewardTrainer
from canntrain_core.rlhf.ppo import PPOTrainer, ScorerService
from canntrain_core.stages.sft import SFTTrainer
from canntrain_core.train.trainer import Trainer

STAGES: dict[str, type[Trainer]] = {
    "pretrain": Trainer,
    "sft": SFTTrainer,
    "reward": RewardTrainer,
    "dpo": DPOTrainer,
    "grpo": GRPOTrainer,
    "ppo": PPOTrainer,
}


def make_trainer(recipe: Recipe, **kwargs) -> Trainer | ScorerService:
    """The trainer of the recipe's stage (``kwargs``: the Trainer's run_dir, resume_from, accelerator, progress).

    PPO's separated placement (``rlhf.device_placement: separated``): the ranks past ``distributed.world_size``
    hold the reference and the reward model and serve the trainer's ranks (:class:`ScorerService`)."""
    if recipe.train_mode == "ppo" and int(os.environ.get("RANK", "0")) >= recipe.distributed.world_size:
        return ScorerService(recipe, **kwargs)
    return STAGES[recipe.train_mode](recipe, **kwargs)
