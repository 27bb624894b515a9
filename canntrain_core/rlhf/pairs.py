"""Offline alignment on preference pairs ``{"prompt", "chosen", "rejected"}``: the reward model and DPO.

Both run the pretraining loop (``Trainer.fit``) on rows holding a pair; only the loss differs:

- ``train_mode: reward``: a scalar head on the Llama backbone (the fine-tuned model, ``model.init_from``)
  scores the last token of each answer; loss -log sigmoid(r_chosen - r_rejected); the held-out pair
  accuracy ``val_accuracy`` (TRL's RewardTrainer ``eval_accuracy``) is the share of pairs it orders right;
- ``train_mode: dpo``: no reward model: the policy's and a frozen reference's log-probabilities of each
  answer give DPO's sigmoid loss (``rlhf.beta``, ``rlhf.label_smoothing``); ``val_rewards/accuracies``
  (TRL's DPOTrainer ``eval_rewards/accuracies``) is the share of held-out pairs whose implicit reward
  margin is positive.
"""

from __future__ import annotations

import torch

from canntrain_core.data.cache import DataError
from canntrain_core.data.sampler import ResumableSampler
from canntrain_core.losses import dpo_loss, pairwise_reward_loss
from canntrain_core.models.lifecycle import build_frozen_model, build_training_model
from canntrain_core.models.rollout import layout, token_logprobs
from canntrain_core.rlhf.data import encode_answer, read_pairs
from canntrain_core.rlhf.frozen import sequence_scores
from canntrain_core.train.trainer import Trainer
from canntrain_core.data.tokenizer import TokenText


class PairBundle(TokenText):
    """Preference pairs as fixed-length rows: chosen / rejected ids and their answer-token masks."""

    def __init__(self, cfg, seed, dp_rank, dp_size, tokenizer, vocab_size=None, chat_template=None):
        from canntrain_core.finetune.format import ChatFormat
        from canntrain_core.rlhf.data import _is_val

        if tokenizer is None:
            raise DataError(
                "preference training starts from a fine-tuned model: model.init_from must hold tokenizer.json"
            )
        pairs, bad = read_pairs(cfg.source, cfg.on_bad_record)
        self.cfg, self.tokenizer, self.eos_id = cfg, tokenizer.tokenizer, tokenizer.eos_id
        self.vocab_size = vocab_size or cfg.tokenizer.vocab_size
        fmt = ChatFormat(tokenizer.tokenizer, tokenizer.eos_id, cfg.template, chat_template)
        rows = {"train": [], "val": []}
        L = cfg.seq_length + 1
        for p in pairs:
            (c, nc), (r, nr) = encode_answer(fmt, p.prompt, p.chosen), encode_answer(fmt, p.prompt, p.rejected)
            ro = layout([c[:nc], r[:nr]], [c[nc:], r[nr:]], self.eos_id, self.eos_id)
            if ro.ids.shape[1] > L:  # a pair is never truncated: both answers would lose what tells them apart
                why = f"over-long: {ro.ids.shape[1]} tokens > {L} (data.seq_length + 1)"
                if cfg.on_bad_record == "error":
                    raise DataError(
                        f"{cfg.source}, line {p.name.rsplit(':', 1)[1]}: {why} (or set data.on_bad_record=skip)"
                    )
                bad.append(f"{p.name}: {why}")
                continue
            ids = torch.full((2, L), self.eos_id)
            ids[:, : ro.ids.shape[1]] = ro.ids
            mask = torch.zeros((2, L - 1))
            mask[:, : ro.mask.shape[1]] = ro.mask
            rows["val" if _is_val(p.name, cfg.val_fraction) else "train"].append({"ids": ids, "mask": mask})
        self.train, self.val = rows["train"], rows["val"]
        self.sampler = ResumableSampler(len(self.train), seed=seed, dp_rank=dp_rank, dp_size=dp_size)
        self.info = {
            "source": str(cfg.source),
            "pairs": len(pairs),
            "train_pairs": len(self.train),
            "val_pairs": len(self.val),
            "bad_records": len(bad),
            "bad_record_examples": bad[:10],
            "tokenizer_source": "given",
            "tokenizer_path": str(tokenizer.path),
            "chat_template": fmt.source if chat_template is not None else "data.template",
        }
        self.format = fmt

    def train_loader(self):
        from torch.utils.data import DataLoader

        return DataLoader(self.train, batch_size=self.cfg.batch_size, sampler=self.sampler, drop_last=True)

    def val_batches(self, n_samples: int, batch_size: int, dp_rank: int = 0, dp_size: int = 1) -> list[dict]:
        total = min(n_samples, len(self.val)) // (batch_size * dp_size) * batch_size * dp_size
        mine = list(range(dp_rank, total, dp_size))
        return [
            {k: torch.stack([self.val[i][k] for i in mine[j : j + batch_size]]) for k in ("ids", "mask")}
            for j in range(0, len(mine), batch_size)
        ]


class PairTrainer(Trainer):
    formats_conversations = True
    accuracy_key = "val_accuracy"  # the held-out share of pairs ordered right, by TRL's name for the stage

    def build_data(self, config):
        r = self.recipe
        return PairBundle(r.data, r.experiment.seed, *self.dp, **self.tokenizer_args(config))

    def train_step(self, micro_batches: list) -> torch.Tensor:
        total = torch.zeros((), device=self.acc.device)
        for b in micro_batches:
            with self.acc.autocast(self.recipe.model.precision):
                loss, _ = self.pair_loss(b)
            self.scaler.scale(loss / len(micro_batches)).backward()  # the loop unscales (fp16) before clipping
            total += loss.detach() / len(micro_batches)
        return total

    @torch.no_grad()
    def evaluate(self, batches: list) -> dict[str, float]:
        if not batches:  # data.val_fraction 0
            return {}
        self.model.eval()
        losses, right = [], []
        for b in batches:
            with self.acc.autocast(self.recipe.model.precision):
                loss, correct = self.pair_loss(b)
            losses.append(loss)
            right.append(correct)
        val_loss = self._mean_over_ranks(torch.stack(losses).mean())
        return {"val_loss": val_loss, self.accuracy_key: self._mean_over_ranks(torch.stack(right).mean())}

    def pair_loss(self, b) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError


class RewardTrainer(PairTrainer):
    train_modes = ("reward",)
    not_a_language_model = (
        "a reward model scores answers with a one-row head, it is not a language model; "
        "PPO reads its checkpoint as it is (rlhf.reward_model)"
    )

    def models(self) -> dict:
        return {"reward": self.model}

    def build_model(self, config, fill: bool):
        return build_training_model(
            self.recipe, config, self.acc.device, self.mesh, self.dims, fill=fill, head="scalar"
        )

    def pair_loss(self, b):
        ids, mask = b["ids"].to(self.acc.device), b["mask"].to(self.acc.device)
        scores = sequence_scores(self.model, ids.flatten(0, 1), mask.flatten(0, 1)).view(-1, 2)
        return pairwise_reward_loss(scores[:, 0], scores[:, 1]).mean(), (scores[:, 0] > scores[:, 1]).float().mean()


class DPOTrainer(PairTrainer):
    train_modes = ("dpo",)
    accuracy_key = "val_rewards/accuracies"

    def models(self) -> dict:
        return {"policy": self.model, "reference": self.reference}

    def build_model(self, config, fill: bool):
        built = super().build_model(config, fill)
        self.reference = build_frozen_model(self.recipe, config, self.acc.device, self.mesh, self.dims)
        return built

    def pair_loss(self, b):
        ids, mask = b["ids"].to(self.acc.device).flatten(0, 1), b["mask"].to(self.acc.device).flatten(0, 1)
        logp = (token_logprobs(self.model, ids) * mask).sum(-1).view(-1, 2)
        with torch.no_grad():
            ref = (token_logprobs(self.reference, ids) * mask).sum(-1).view(-1, 2)
        h = self.recipe.rlhf
        loss, margin = dpo_loss(logp[:, 0], logp[:, 1], ref[:, 0], ref[:, 1], h.beta, h.label_smoothing)
        return loss.mean(), (margin > 0).float().mean()
