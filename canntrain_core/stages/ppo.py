"""PPO with an actor, a critic, a frozen reference and a reward model. Read ``fit``.

Each iteration (one ``step``):

1. rollout: the actor samples one response per prompt (``data.batch_size`` prompts per rank), in
   inference mode with a KV cache, ``rlhf.generate_max_length`` new tokens at most;
2. experience: the actor's and the reference's log-probabilities of the sampled tokens, the critic's
   values, and the score (the reward model's, ``rlhf.reward_model``, else the programmatic one), minus
   ``rlhf.missing_eos_penalty`` for a response that never ended; per-token rewards are
   -kl_coeff x the ``rlhf.kl_estimator`` estimate of KL(actor || reference) (default k1,
   log pi - log ref: TRL's and verl's) with the score added on the last token; GAE gives advantages
   (``gamma``, ``lam``), whitened over the rollout's tokens with the unbiased variance
   (``whiten_advantages``, TRL's and verl's ``masked_whiten``) and returns;
3. update: ``rlhf.ppo_epochs`` passes over shuffled mini-batches of ``rlhf.mini_batch_size``
   responses; loss = clipped policy loss + value_coeff x clipped value loss, one optimizer over
   actor and critic (as TRL's PolicyAndValueWrapper), gradients clipped together;
4. with ``rlhf.target_kl`` the KL coefficient adapts (Ziegler et al.'s proportional controller, TRL's
   horizon of 10,000 responses), on the KL summed over each response and averaged over responses (the
   legacy TRL controller's ``mean_kl``; verl's controller reads the per-token mean instead).

Metrics are named as verl names them (docs/alignment.md); the iteration's KL to the reference is
``actor/reward_kl_penalty`` (each response's mean over its tokens, averaged over responses), the
coefficient that weighed it ``actor/reward_kl_penalty_coeff``.

Where the reference and the reward model run is ``rlhf.device_placement`` (``stages.frozen``).
"""

from __future__ import annotations

import time

import torch
from torch import nn

from canntrain_core.checkpoint.dcp import load_model_weights
from canntrain_core.losses import (
    clipped_policy_loss,
    clipped_value_loss,
    gae,
    kl_penalty,
    masked_mean,
    masked_whiten,
)
from canntrain_core.models.lifecycle import BuiltModel, build_training_model
from canntrain_core.models.registry import model_config
from canntrain_core.models.rollout import token_logprobs, token_values
from canntrain_core.runtime import get_accelerator, seed_everything
from canntrain_core.runtime.distributed import ParallelDims, exchange_group, init_distributed
from canntrain_core.stages.frozen import FrozenModels, RemoteFrozenModels, reward_checkpoint, serve
from canntrain_core.stages.online import OnlineTrainer

KL_HORIZON = 10_000


class ActorCritic(nn.Module):
    """The two models PPO trains, as one module: one optimizer, one checkpoint (``actor.*``, ``critic.*``)."""

    def __init__(self, actor: nn.Module, critic: nn.Module):
        super().__init__()
        self.actor, self.critic = actor, critic


class PPOTrainer(OnlineTrainer):
    train_modes = ("ppo",)
    language_model = "actor."  # the actor is the language model it trains; the critic stays behind

    @staticmethod
    def extra_ranks(recipe) -> int:
        h = recipe.rlhf
        return h.scorer_ranks if h.device_placement == "separated" else 0

    def build_model(self, config, fill: bool):
        r, h, dev = self.recipe, self.recipe.rlhf, self.acc.device
        rm = reward_checkpoint(h.reward_model) if h.reward_model else None  # a bad path fails before any weights
        actor = build_training_model(r, config, dev, self.mesh, self.dims, fill=fill)
        critic = build_training_model(
            r, config, dev, self.mesh, self.dims, fill=fill and not h.reward_model, head="scalar"
        ).model
        if fill and rm:  # the critic starts as the reward model (OpenRLHF's default)
            load_model_weights(rm, critic, verify=False)
        if h.device_placement == "shared":
            frozen = FrozenModels.build(r, config, dev, self.mesh, self.dims, reward_ckpt=rm)
        else:
            group, me = exchange_group()
            frozen = RemoteFrozenModels(
                group, r.distributed.world_size + me % h.scorer_ranks, h.kl_coeff > 0, bool(h.reward_model)
            )
        held = {"policy": actor.model, "critic": critic, "frozen": frozen, "kl_coeff": h.kl_coeff}
        return BuiltModel(ActorCritic(actor.model, critic), config, None, actor.source, actor.loaded, held)

    @staticmethod
    def roles(recipe) -> list[tuple[str, bool, bool]]:
        h = recipe.rlhf
        frozen = [("reference", False, False)] * (h.kl_coeff > 0) + [("reward", False, True)] * bool(h.reward_model)
        return [("actor", True, False), ("critic", True, True)] + frozen

    @staticmethod
    def rows(recipe) -> tuple[int, int]:
        return recipe.rlhf.mini_batch_size, recipe.data.batch_size  # one response per prompt

    def models(self) -> dict:
        """Every model this rank holds, by the names ``memory.alignment`` gives them."""
        found = {"actor": self.policy, "critic": self.critic}
        if isinstance(self.frozen, FrozenModels):
            found.update(reference=self.frozen.reference, reward=self.frozen.reward_model)
        return {k: v for k, v in found.items() if v is not None}

    def extra_state(self) -> dict:
        return {"kl_coeff": self.kl_coeff}

    def load_extra_state(self, state: dict) -> None:
        self.kl_coeff = state.get("kl_coeff", self.kl_coeff)

    def train_iteration(self, batch) -> dict:
        """Roll out, score (experience), then ``rlhf.ppo_epochs`` passes over mini-batches; adapt the KL
        coefficient."""
        r = self.recipe
        lr = self.scheduler.get_last_lr()[0]
        prompts, ro, timing = self.sampled(batch, 1, r.rlhf.temperature)
        t1 = time.perf_counter()
        exp, record = self.experience(ro, prompts)
        t2 = time.perf_counter()
        record.update(self.update(exp))
        t3 = time.perf_counter()
        self.adapt_kl(exp["kl_sum"])
        gen_tokens, ids = float(exp["mask"].sum()), exp["ids"]
        record.update(
            {
                "lr": lr,
                "response_length/mean": gen_tokens / len(ids),
                **timing,
                "timing_s/score": t2 - t1,
                "timing_s/update": t3 - t2,
                "perf/generation_tokens_per_second": gen_tokens / timing["timing_s/gen"],
                "perf/train_tokens_per_second": r.rlhf.ppo_epochs * ids.numel() / (t3 - t2),
                **self.push_weights(),
            }
        )
        return record

    def close(self) -> None:
        super().close()
        self.frozen.close()  # the scorer ranks (separated placement) stop serving

    @torch.no_grad()
    def experience(self, ro, prompts) -> tuple[dict, dict]:
        """Everything the update needs from one rollout, and the iteration's score metrics."""
        h, dev = self.recipe.rlhf, self.acc.device
        ids, mask = ro.ids.to(dev), ro.mask.to(dev)
        with self.compute():
            recomputed, ent = token_logprobs(self.policy, ids, h.temperature, with_entropy=True)
            values = token_values(self.critic, ids) * mask
            ref, learned = self.frozen(ids, mask)
        old, engine_figures = self.behaviour_logprobs(ro, recomputed, mask)
        true = self.true_scores(ro, prompts).to(dev)
        score = (learned if learned is not None else true) - h.missing_eos_penalty * (~ro.ended).float().to(dev)
        kl = kl_penalty(old, ref, h.kl_estimator or "k1") * mask if ref is not None else torch.zeros_like(old)
        rewards = -self.kl_coeff * kl
        rewards[torch.arange(len(ids)), ro.last.to(dev)] += score
        adv, returns = gae(rewards, values, mask, h.gamma, h.lam)
        if h.whiten_advantages:
            adv = masked_whiten(adv, mask)
        lengths, seq_rewards = mask.sum(-1), rewards.sum(-1)
        record = {
            "true_score/mean": float(true.mean()),
            "critic/score/mean": float(score.mean()),
            "critic/score/max": float(score.max()),
            "critic/score/min": float(score.min()),
            "critic/rewards/mean": float(seq_rewards.mean()),
            "critic/rewards/max": float(seq_rewards.max()),
            "critic/rewards/min": float(seq_rewards.min()),
            "actor/reward_kl_penalty": float(masked_mean(kl, mask, dim=-1).mean()),
            "actor/reward_kl_penalty_coeff": self.kl_coeff,
            "actor/entropy": float(masked_mean(ent, mask)),
            "response_length/clip_ratio": float((lengths == h.generate_max_length).float().mean()),
            **engine_figures,
        }
        return {
            "ids": ids,
            "mask": mask,
            "old": old,
            "values": values,
            "adv": adv,
            "returns": returns,
            "kl_sum": float(kl.sum(-1).mean()),
        }, record

    def update(self, e: dict) -> dict:
        """``ppo_epochs`` passes over mini-batches; the mean of each statistic over them."""
        h, stats = self.recipe.rlhf, {}
        self.model.train()
        for _ in range(h.ppo_epochs):
            for mb in torch.randperm(len(e["ids"])).split(h.mini_batch_size):
                m, old = e["mask"][mb], e["old"][mb]
                with self.compute():
                    logp = token_logprobs(self.policy, e["ids"][mb], h.temperature)
                    values = token_values(self.critic, e["ids"][mb])
                pg, clip_frac = clipped_policy_loss(logp, old, e["adv"][mb], m, h.clip_range, aggregation="token")
                vf, vf_clip_frac = clipped_value_loss(values, e["values"][mb], e["returns"][mb], m, h.value_clip_range)
                self.scaler.scale(pg + h.value_coeff * vf).backward()
                ppo_kl = masked_mean(old - logp.detach(), m)
                for k, v in (
                    ("actor/grad_norm", self.optimizer_step()),
                    ("actor/pg_loss", pg),
                    ("critic/vf_loss", vf),
                    ("actor/pg_clipfrac", clip_frac),
                    ("critic/vf_clipfrac", vf_clip_frac),
                    ("actor/ppo_kl", ppo_kl),
                ):
                    stats.setdefault(k, []).append(float(v.detach()) if torch.is_tensor(v) else v)
        return {k: sum(v) / len(v) for k, v in stats.items()}

    def adapt_kl(self, kl: float) -> None:
        """Ziegler et al.'s controller: move the coefficient toward ``rlhf.target_kl`` (no-op without one)."""
        h = self.recipe.rlhf
        if h.target_kl is None or self.kl_coeff == 0:
            return
        kl = self._averaged({"kl_sum": kl})["kl_sum"]  # every data-parallel rank keeps the same coefficient
        error = max(-0.2, min(0.2, kl / h.target_kl - 1))
        self.kl_coeff *= 1 + error * self.recipe.data.batch_size * self.dims.dp / KL_HORIZON


class ScorerService:
    """A scorer rank of separated placement: holds whole copies of the frozen models and serves the actor
    ranks assigned to it until each says stop. Outside the trainer's process group; writes nothing."""

    def __init__(self, recipe, run_dir=None, progress: bool = False, **_):
        self.recipe, self.acc = recipe, get_accelerator()
        init_distributed(self.acc, recipe.distributed, PPOTrainer.extra_ranks(recipe))
        self.group, self.rank = exchange_group()
        seed_everything(recipe.experiment.seed)
        config = model_config(recipe.model, recipe.data.tokenizer.vocab_size)
        single = ParallelDims(1, 1, 1, 1, 1)
        self.frozen = FrozenModels.build(recipe, config, self.acc.device, None, single)
        n, k = recipe.distributed.world_size, recipe.rlhf.scorer_ranks
        self.clients = [a for a in range(n) if n + a % k == self.rank]

    def fit(self, stop_after: int | None = None):
        served = serve(self.frozen, self.group, self.clients, self.acc.device)
        return f"scorer rank {self.rank}: scored {served} rollouts for actor rank(s) {self.clients}"
