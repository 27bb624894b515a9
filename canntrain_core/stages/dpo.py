"""``train_mode: dpo``: no reward model: the policy's and a frozen reference's log-probabilities of each
answer give DPO's sigmoid loss (``rlhf.beta``, ``rlhf.label_smoothing``). ``val_rewards/accuracies``
(TRL's DPOTrainer ``eval_rewards/accuracies``) is the share of held-out pairs whose implicit reward margin
is positive.
"""

from __future__ import annotations

import dataclasses

import torch

from canntrain_core.losses import dpo_loss
from canntrain_core.models.lifecycle import build_frozen_model
from canntrain_core.models.rollout import token_logprobs
from canntrain_core.stages.pairs import PairTrainer


class DPOTrainer(PairTrainer):
    train_modes = ("dpo",)
    accuracy_key = "val_rewards/accuracies"

    def models(self) -> dict:
        return {"policy": self.model, "reference": self.reference}

    @staticmethod
    def roles(recipe) -> list[tuple[str, bool, bool]]:
        return [("policy", True, False), ("reference", False, False)]

    def build_model(self, config, fill: bool):
        built = super().build_model(config, fill)
        reference = build_frozen_model(self.recipe, config, self.acc.device, self.mesh, self.dims)
        return dataclasses.replace(built, held={"reference": reference})

    def pair_loss(self, b):
        ids, mask = b["ids"].to(self.acc.device).flatten(0, 1), b["mask"].to(self.acc.device).flatten(0, 1)
        logp = (token_logprobs(self.model, ids) * mask).sum(-1).view(-1, 2)
        with torch.no_grad():
            ref = (token_logprobs(self.reference, ids) * mask).sum(-1).view(-1, 2)
        h = self.recipe.rlhf
        loss, margin = dpo_loss(logp[:, 0], logp[:, 1], ref[:, 0], ref[:, 1], h.beta, h.label_smoothing)
        return loss.mean(), (margin > 0).float().mean()
