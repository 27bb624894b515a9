"""What the offline alignment stages share (``stages/reward.py``, ``stages/dpo.py``): preference pairs
``{"prompt", "chosen", "rejected"}`` as rows, and the engine's loop (``Trainer.fit``) over them; each stage
gives its pair loss and the held-out accuracy it reports.
"""

from __future__ import annotations

import torch

from canntrain_core.data.cache import DataError
from canntrain_core.data.sampler import ResumableSampler, train_loader, val_share
from canntrain_core.models.rollout import layout
from canntrain_core.finetune.alignment_data import encode_answer, read_pairs
from canntrain_core.finetune.format import ChatFormat
from canntrain_core.finetune.records import is_val, read_sources
from canntrain_core.train.trainer import Trainer
from canntrain_core.data.tokenizer import TokenText


class PairBundle(TokenText):
    """Preference pairs as fixed-length rows: chosen / rejected ids and their answer-token masks."""

    def __init__(self, cfg, seed, dp_rank, dp_size, tokenizer, vocab_size=None, chat_template=None):
        if tokenizer is None:
            raise DataError(
                "preference training starts from a fine-tuned model: model.init_from must hold tokenizer.json"
            )
        sources = read_sources(cfg, lambda path: read_pairs(path, cfg.on_bad_record))
        self.cfg, self.tokenizer, self.eos_id = cfg, tokenizer.tokenizer, tokenizer.eos_id
        self.vocab_size = vocab_size or cfg.tokenizer.vocab_size
        fmt = ChatFormat(tokenizer.tokenizer, tokenizer.eos_id, cfg.template, chat_template)
        self.train, self.val, bad, sizes = [], [], [], []
        L = cfg.seq_length + 1
        for src in sources:
            bad += src.bad
            before = len(self.train)
            for p in src.items:
                (c, nc), (r, nr) = encode_answer(fmt, p.prompt, p.chosen), encode_answer(fmt, p.prompt, p.rejected)
                ro = layout([c[:nc], r[:nr]], [c[nc:], r[nr:]], self.eos_id, self.eos_id)
                if ro.ids.shape[1] > L:  # a pair is never truncated: both answers would lose what tells them apart
                    why = f"over-long: {ro.ids.shape[1]} tokens > {L} (data.seq_length + 1)"
                    if cfg.on_bad_record == "error":
                        raise DataError(f"{p.where}: {why} (or set data.on_bad_record=skip)")
                    bad.append(f"{p.name}: {why}")
                    continue
                ids = torch.full((2, L), self.eos_id)
                ids[:, : ro.ids.shape[1]] = ro.ids
                mask = torch.zeros((2, L - 1))
                mask[:, : ro.mask.shape[1]] = ro.mask
                (self.val if is_val(p.name, cfg.val_fraction) else self.train).append({"ids": ids, "mask": mask})
            sizes.append(len(self.train) - before)
        if not all(sizes):
            raise DataError(f"{', '.join(s.path for s in sources)}: no training pairs in a source ({sizes})")
        self.sampler = ResumableSampler(
            sizes, seed=seed, dp_rank=dp_rank, dp_size=dp_size, weights=[s.weight for s in sources]
        )
        self.names = [s.name for s in sources]
        self.info = {
            "source": ", ".join(s.path for s in sources),
            "pairs": sum(len(s.items) for s in sources),
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
        return train_loader(self.train, self.sampler, self.cfg)

    def val_batches(self, n_samples: int, batch_size: int, dp_rank: int = 0, dp_size: int = 1) -> list[dict]:
        share = val_share(
            len(self.val), n_samples, batch_size, dp_rank, dp_size, "raise data.val_fraction or lower data.batch_size"
        )
        return [{k: torch.stack([self.val[i][k] for i in batch]) for k in ("ids", "mask")} for batch in share]


class PairTrainer(Trainer):
    formats_conversations = True
    accuracy_key = "val_accuracy"  # the held-out share of pairs ordered right, by TRL's name for the stage

    @staticmethod
    def rows(recipe) -> tuple[int, int]:
        return 2 * recipe.data.batch_size, 0  # a pair is two rows

    def build_data(self, config):
        r = self.recipe
        return PairBundle(r.data, r.experiment.seed, *self.dp, **self.tokenizer_args(config))

    def train_step(self, micro_batches: list) -> torch.Tensor:
        total = torch.zeros((), device=self.acc.device)
        for b in micro_batches:
            with self.timer("forward"), self.acc.autocast(self.recipe.model.precision):
                loss, _ = self.pair_loss(b)
            with self.timer("backward"):
                self.scaler.scale(loss / len(micro_batches)).backward()  # the loop unscales (fp16) before clipping
            total += loss.detach() / len(micro_batches)
        return total

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        batches = self.val_batches
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
