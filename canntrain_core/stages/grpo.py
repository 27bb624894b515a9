"""GRPO: group-relative policy optimisation, scored by the program that checks the answers. Read ``fit``.

Each iteration: for ``data.batch_size`` prompts the policy samples ``rlhf.group_size`` answers; the
programmatic scorer scores them; each answer's advantage is its score minus its group's mean over the
group's standard deviation (every token of the answer gets it); then ``rlhf.ppo_epochs`` passes of
clipped policy-gradient steps over mini-batches of ``rlhf.mini_batch_size`` responses (clip range
``clip_range`` below 1, ``clip_range_high`` above: DAPO's clip-higher), with ``rlhf.kl_coeff`` x the
``rlhf.kl_estimator`` estimate (default k3, TRL's and DeepSeekMath's) of KL(policy || reference) in the
loss (0 loads no reference). ``rlhf.loss_aggregation`` says how token losses become one number
(``losses.aggregate``); the policy and the KL term share it, as in TRL and verl. No critic and no reward
model: that is the memory GRPO saves over PPO. Metrics are named as verl names them (docs/alignment.md).
"""

from __future__ import annotations

import dataclasses

import time

import torch

from canntrain_core.losses import aggregate, clipped_policy_loss, group_advantages, kl_penalty, masked_mean
from canntrain_core.models.lifecycle import build_frozen_model
from canntrain_core.models.rollout import token_logprobs
from canntrain_core.stages.online import OnlineTrainer


class GRPOTrainer(OnlineTrainer):
    train_modes = ("grpo",)

    @property
    def samples_per_prompt(self) -> int:
        return self.recipe.rlhf.group_size

    def build_model(self, config, fill: bool):
        built = super().build_model(config, fill)
        reference = None
        if self.recipe.rlhf.kl_coeff > 0:  # frozen, always the init_from weights
            reference = build_frozen_model(self.recipe, config, self.acc.device, self.mesh, self.dims)
        return dataclasses.replace(built, held={"policy": built.model, "reference": reference})

    def models(self) -> dict:
        return {"policy": self.model, **({"reference": self.reference} if self.reference is not None else {})}

    @staticmethod
    def roles(recipe) -> list[tuple[str, bool, bool]]:
        return [("policy", True, False)] + [("reference", False, False)] * (recipe.rlhf.kl_coeff > 0)

    def train_iteration(self, batch) -> dict:
        """Sample a group per prompt, score, then ``rlhf.ppo_epochs`` passes of clipped policy-gradient steps."""
        h = self.recipe.rlhf
        G, T, estimator = h.group_size, h.temperature, h.kl_estimator or "k3"
        agg = {"aggregation": h.loss_aggregation, "max_tokens": h.generate_max_length}
        lr = self.scheduler.get_last_lr()[0]
        prompts, ro, timing = self.sampled(batch, G, T)
        t1 = time.perf_counter()
        scores = self.true_scores(ro, prompts, G)
        adv = group_advantages(scores, G, h.scale_rewards).to(self.acc.device)
        ids, mask = ro.ids.to(self.acc.device), ro.mask.to(self.acc.device)
        with torch.no_grad(), self.compute():
            recomputed, ent = token_logprobs(self.model, ids, T, with_entropy=True)
            ref = token_logprobs(self.reference, ids, T) if self.reference is not None else None
        old, engine_figures = self.behaviour_logprobs(ro, recomputed, mask)
        t2 = time.perf_counter()
        stats: dict[str, list[float]] = {}
        self.model.train()
        for _ in range(h.ppo_epochs):
            for mb in torch.randperm(len(ids)).split(h.mini_batch_size):
                m = mask[mb]
                tokens = self.step_tokens(m) if h.loss_aggregation == "dapo" else None
                with self.compute():
                    logp = token_logprobs(self.model, ids[mb], T)
                a = adv[mb][:, None].expand_as(logp)
                pg, clip_frac = clipped_policy_loss(
                    logp, old[mb], a, m, h.clip_range, h.clip_range_high, tokens=tokens, **agg
                )
                kl = torch.zeros((), device=logp.device)
                if ref is not None:
                    kl = aggregate(
                        kl_penalty(logp, ref[mb], estimator), m, h.loss_aggregation, h.generate_max_length, tokens
                    )
                self.scaler.scale(pg + h.kl_coeff * kl).backward()
                ppo_kl = masked_mean(old[mb] - logp.detach(), m)
                for k, v in (
                    ("actor/grad_norm", self.optimizer_step()),
                    ("actor/pg_loss", pg),
                    ("actor/pg_clipfrac", clip_frac),
                    ("actor/ppo_kl", ppo_kl),
                    *((("actor/kl_loss", kl),) if ref is not None else ()),
                ):
                    stats.setdefault(k, []).append(float(v.detach()) if torch.is_tensor(v) else v)
        t3 = time.perf_counter()
        gen_tokens = float(mask.sum())
        lengths = mask.sum(-1)
        record = {
            "true_score/mean": float(scores.mean()),
            "critic/score/mean": float(scores.mean()),
            "critic/score/max": float(scores.max()),
            "critic/score/min": float(scores.min()),
            "response_length/mean": gen_tokens / len(ids),
            "response_length/clip_ratio": float((lengths == h.generate_max_length).float().mean()),
            "actor/entropy": float(
                aggregate(
                    ent, mask, "bnpo" if h.loss_aggregation == "dapo" else h.loss_aggregation, h.generate_max_length
                )
            ),
            "lr": lr,
            **({"actor/kl_coef": h.kl_coeff} if ref is not None else {}),
            **{k: sum(v) / len(v) for k, v in stats.items()},
            **timing,
            "timing_s/score": t2 - t1,
            "timing_s/update": t3 - t2,
            "perf/generation_tokens_per_second": gen_tokens / timing["timing_s/gen"],
            "perf/train_tokens_per_second": h.ppo_epochs * ids.numel() / (t3 - t2),
            **engine_figures,
            **self.push_weights(),
        }
        return record

    def step_tokens(self, mask: torch.Tensor) -> float:
        """``dapo``'s normaliser: the generated tokens of this optimizer step's mini-batch summed over the
        data-parallel ranks, divided by their number (TRL's ``num_items_in_batch / num_processes``)."""
        return self._sum_over_dp(mask.sum(), everywhere=True) / self.dims.dp
