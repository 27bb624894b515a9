"""GRPO: group-relative policy optimisation, scored by the program that checks the answers. Read ``fit``.

Each iteration: for ``data.batch_size`` prompts the policy samples ``rlhf.group_size`` answers; the
programmatic scorer scores them; each answer's advantage is its score minus its group's mean over the
group's standard deviation (every token of the answer gets it); then ``rlhf.ppo_epochs`` passes of
clipped policy-gradient steps over mini-batches of ``rlhf.mini_batch_size`` responses (clip range
``clip_range`` below 1, ``clip_range_high`` above: DAPO's clip-higher), with the k3 estimate of
KL(policy || reference) in the loss (``rlhf.kl_coeff``; 0 loads no reference). ``rlhf.loss_aggregation``
says how token losses become one number (``losses.aggregate``). No critic and no reward model: that is
the memory GRPO saves over PPO.
"""

from __future__ import annotations

import time

import torch

from canntrain_core.models.lifecycle import build_training_model
from canntrain_core.rlhf.losses import aggregate, clipped_policy_loss, group_advantages, kl_penalty, masked_mean
from canntrain_core.rlhf.online import OnlineTrainer
from canntrain_core.rlhf.rollout import token_logprobs


class GRPOTrainer(OnlineTrainer):
    def build_model(self, config, fill: bool):
        built = super().build_model(config, fill)
        self.policy, self.reference = built.model, None
        if self.recipe.rlhf.kl_coeff > 0:  # frozen, always the init_from weights
            self.reference = build_training_model(self.recipe, config, self.acc.device, self.mesh, self.dims).model
            self.reference.requires_grad_(False).eval()
        return built

    def models(self) -> dict:
        return {"policy": self.model, **({"reference": self.reference} if self.reference is not None else {})}

    def fit(self, stop_after: int | None = None):
        r, h = self.recipe, self.recipe.rlhf
        G, T = h.group_size, h.temperature
        it, bar = iter(self.data.sampler), self.progress_bar()
        if self.step == 0:
            self._write({"step": 0, **self.evaluate()})
        while self.step < r.optim.max_steps:
            lr = self.scheduler.get_last_lr()[0]
            prompts = self.next_prompts(it)
            t0 = time.perf_counter()
            ro = self.rollout(prompts, G, T)
            t1 = time.perf_counter()
            scores = self.true_scores(ro, prompts, G)
            adv = group_advantages(scores, G, h.scale_rewards).to(self.acc.device)
            ids, mask = ro.ids.to(self.acc.device), ro.mask.to(self.acc.device)
            with torch.no_grad(), self.compute():
                old = token_logprobs(self.model, ids, T)
                ref = token_logprobs(self.reference, ids, T) if self.reference is not None else None
            t2 = time.perf_counter()
            stats: dict[str, list[float]] = {}
            self.model.train()
            for _ in range(h.ppo_epochs):
                for mb in torch.randperm(len(ids)).split(h.mini_batch_size):
                    m = mask[mb]
                    with self.compute():
                        logp, ent = token_logprobs(self.model, ids[mb], T, with_entropy=True)
                    a = adv[mb][:, None].expand_as(logp)
                    pg, clip_frac = clipped_policy_loss(logp, old[mb], a, m, h.clip_range, h.clip_range_high,
                                                        h.loss_aggregation)
                    kl = torch.zeros((), device=logp.device)
                    if ref is not None:
                        kl = aggregate(kl_penalty(logp, ref[mb], "k3"), m, h.loss_aggregation, h.generate_max_length)
                    (pg + h.kl_coeff * kl).backward()
                    for k, v in (("grad_norm", self.optimizer_step()), ("policy_loss", pg), ("kl", kl),
                                 ("clip_fraction", clip_frac), ("approx_kl", masked_mean(old[mb] - logp.detach(), m)),
                                 ("entropy", masked_mean(ent.detach(), m))):
                        stats.setdefault(k, []).append(float(v.detach()) if torch.is_tensor(v) else v)
            t3 = time.perf_counter()
            gen_tokens = float(mask.sum())
            record = {"score_mean": float(scores.mean()), "score_std": float(scores.std()),
                      "response_length": gen_tokens / len(ids), "lr": lr,
                      **{k: sum(v) / len(v) for k, v in stats.items()},
                      "time_generation": t1 - t0, "time_scoring": t2 - t1, "time_update": t3 - t2,
                      "generation_tokens_per_second": gen_tokens / (t1 - t0),
                      "train_tokens_per_second": h.ppo_epochs * ids.numel() / (t3 - t2)}
            if self.finish_iteration(record, stop_after, bar):
                break
        bar.close()
        return self.result()
