"""``train_mode: reward``: a scalar head on the backbone (the fine-tuned model, ``model.init_from``) scores
the last token of each answer; loss -log sigmoid(r_chosen - r_rejected). The held-out pair accuracy
``val_accuracy`` (TRL's RewardTrainer ``eval_accuracy``) is the share of pairs it orders right.
"""

from __future__ import annotations

from canntrain_core.losses import pairwise_reward_loss
from canntrain_core.models.lifecycle import build_training_model
from canntrain_core.stages.frozen import sequence_scores
from canntrain_core.stages.pairs import PairTrainer


class RewardTrainer(PairTrainer):
    train_modes = ("reward",)
    not_a_language_model = (
        "a reward model scores answers with a one-row head, it is not a language model; "
        "PPO reads its checkpoint as it is (rlhf.reward_model)"
    )

    def models(self) -> dict:
        return {"reward": self.model}

    @staticmethod
    def roles(recipe) -> list[tuple[str, bool, bool]]:
        return [("reward", True, True)]

    def build_model(self, config, fill: bool):
        return build_training_model(
            self.recipe, config, self.acc.device, self.mesh, self.dims, fill=fill, head="scalar"
        )

    def pair_loss(self, b):
        ids, mask = b["ids"].to(self.acc.device), b["mask"].to(self.acc.device)
        scores = sequence_scores(self.model, ids.flatten(0, 1), mask.flatten(0, 1)).view(-1, 2)
        return pairwise_reward_loss(scores[:, 0], scores[:, 1]).mean(), (scores[:, 0] > scores[:, 1]).float().mean()
