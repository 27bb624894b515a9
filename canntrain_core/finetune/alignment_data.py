"""Alignment data: preference pairs and prompts, encoded with the fine-tuning chat format.

- pairs (reward model, DPO): ``{"prompt": ..., "chosen": ..., "rejected": ...}`` per line;
- prompts (PPO, GRPO): the fine-tuning records themselves (alpaca/messages/ShareGPT); the final
  answer is kept as the reference the programmatic scorer compares a generated answer with.

A bad line is named by file and line, or skipped and counted (``data.on_bad_record``).
:func:`preference_records` makes pairs for the verifiable task whose order the scorer decides.
"""

from __future__ import annotations

import random
import string
from dataclasses import dataclass
from pathlib import Path

import torch

from canntrain_core.data.cache import DataError
from canntrain_core.finetune.format import ChatFormat
from canntrain_core.data.sampler import ResumableSampler
from canntrain_core.finetune.records import (
    BadRecord,
    Conversation,
    is_val,
    read_conversations,
    read_records,
    read_sources,
)
from canntrain_core.finetune.tasks import KINDS, make_item, partial_score
from canntrain_core.data.tokenizer import TokenText


@dataclass(frozen=True)
class Pair:
    name: str
    prompt: str
    chosen: str
    rejected: str
    where: str = ""


def read_pairs(path: str | Path, on_bad_record: str = "error") -> tuple[list[Pair], list[str]]:
    """Every preference pair of a JSONL file, and "file:line: why" for each line left out (``read_records``)."""
    return read_records(path, _pair, "preference pairs", on_bad_record)


def _pair(name: str, where: str, rec: object) -> Pair:
    if not isinstance(rec, dict) or not all(isinstance(rec.get(k), str) for k in ("prompt", "chosen", "rejected")):
        raise BadRecord("a preference pair needs strings 'prompt', 'chosen' and 'rejected'")
    if not rec["chosen"].strip() or not rec["rejected"].strip():
        raise BadRecord("empty chosen or rejected answer")
    return Pair(name, rec["prompt"], rec["chosen"], rec["rejected"], where)


def encode_answer(fmt: ChatFormat, prompt: str, answer: str) -> tuple[list[int], int]:
    """Token ids of prompt + answer (+ end token) and the prompt's length: the answer's tokens are ids[n:]."""
    enc = fmt.encode(Conversation("", (("user", prompt), ("assistant", answer))), "last")
    return enc.ids, enc.prompt_len


def pad_rows(seqs: list[list[int]], pad_id: int, length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded [N, L] ids and the mask of real tokens."""
    length = length or max(len(s) for s in seqs)
    ids = torch.full((len(seqs), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), length), dtype=torch.bool)
    for i, s in enumerate(seqs):
        s = s[:length]
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = True
    return ids, mask


def read_prompts(
    path: str | Path, fmt_name: str = "auto", on_bad_record: str = "error"
) -> tuple[list[Conversation], list[str]]:
    """Conversations whose final answer is the scorer's reference."""
    return read_conversations(path, fmt_name, on_bad_record)


def _corrupt(items: list[str], errors: int, rng: random.Random) -> list[str]:
    """``items`` with ``errors`` random edits: change one, swap two, drop one or add one."""
    out = list(items)
    for _ in range(errors):
        kind = rng.choice(("change", "swap", "drop", "add") if len(out) > 1 else ("change", "add"))
        k = rng.randrange(len(out))
        if kind == "swap":
            a, b = rng.sample(range(len(out)), 2)
            out[a], out[b] = out[b], out[a]
        elif kind == "drop":
            out.pop(k)
        else:
            pool = "0123456789" if out[k].isdigit() else string.ascii_lowercase
            new = rng.choice(pool.upper() if out[k].isupper() else pool)
            if kind == "change":
                out[k] = new
            else:
                out.insert(k, new)
    return out


def preference_records(n: int, seed: int = 0, kinds: tuple[str, ...] = KINDS) -> list[dict]:
    """``n`` preference pairs for the verifiable task, ranked by the programmatic scorer: two answers
    (the correct one, or one with an edit; against one with more edits) of which ``chosen`` scores higher
    by ``partial_score``. A reward model trained on them learns the true score's order, so a PPO run can
    be checked against the truth."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt, answer = make_item(kinds[i % len(kinds)], rng)
        items = answer.split(" ")
        while True:
            good = rng.choice((0, 0, 1))
            a, b = _corrupt(items, good, rng), _corrupt(items, good + rng.randint(1, 2), rng)
            sa, sb = partial_score(" ".join(a), answer), partial_score(" ".join(b), answer)
            if sa != sb and a and b:
                break
        chosen, rejected = (a, b) if sa > sb else (b, a)
        out.append({"prompt": prompt, "chosen": " ".join(chosen), "rejected": " ".join(rejected)})
    return out


@dataclass
class PromptBundle(TokenText):
    """Prompts for online alignment: token ids, the reference answer, a resumable sampler over train."""

    cfg: object
    tokenizer: object
    vocab_size: int
    eos_id: int
    format: ChatFormat
    train: list[tuple[list[int], str]]  # (prompt ids ending where the answer starts, reference answer)
    val: list[tuple[list[int], str]]
    sampler: object
    info: dict
    names: list[str]  # the sources, as their metrics name them

    def train_loader(self):
        """Each iteration's ``data.batch_size`` prompts of this rank, in the sampler's order (advanced by them)."""
        for picked in self.prompt_batches():
            self.sampler.advance(len(picked))
            yield picked

    def prompt_batches(self):
        """The same batches, the sampler left where it is: for a caller that draws ahead of training (a rollout
        engine sampling the next batch) and advances the sampler as it trains on each."""
        it = iter(self.sampler)
        while True:
            yield [self.train[next(it)] for _ in range(self.cfg.batch_size)]

    def val_batches(self, n_samples: int, batch_size: int, dp_rank: int = 0, dp_size: int = 1) -> list:
        """This rank's share of the first ``n_samples`` held-out prompts, ``batch_size`` at a time."""
        mine = self.val[:n_samples][dp_rank::dp_size]
        return [mine[i : i + batch_size] for i in range(0, len(mine), batch_size)]

    def answer_text(self, response: list[int]) -> str:
        """A response's text without its end token."""
        return self.decode(response[:-1] if response and response[-1] == self.eos_id else response)


def build_prompt_data(
    cfg,
    seed: int,
    max_new: int,
    dp_rank: int = 0,
    dp_size: int = 1,
    tokenizer=None,
    vocab_size=None,
    chat_template=None,
) -> PromptBundle:
    """The prompts of ``cfg.source`` (instruction records), split into train and held-out by name. A prompt
    leaves room for ``max_new`` generated tokens within ``data.seq_length``, or is a bad record."""
    if tokenizer is None:
        raise DataError("alignment starts from a fine-tuned model: model.init_from must hold its tokenizer.json")
    sources = read_sources(cfg, lambda path: read_prompts(path, cfg.format, cfg.on_bad_record))
    fmt = ChatFormat(tokenizer.tokenizer, tokenizer.eos_id, cfg.template, chat_template)
    train, val, bad, sizes = [], [], [], []
    for src in sources:
        bad += src.bad
        before = len(train)
        for c in src.items:
            enc = fmt.encode(c, "last")
            if enc.prompt_len + max_new > cfg.seq_length:
                why = (
                    f"over-long: a {enc.prompt_len}-token prompt + rlhf.generate_max_length {max_new} > "
                    f"data.seq_length {cfg.seq_length}"
                )
                if cfg.on_bad_record == "error":
                    raise DataError(f"{c.where}: {why} (or set data.on_bad_record=skip)")
                bad.append(f"{c.name}: {why}")
                continue
            (val if is_val(c.name, cfg.val_fraction) else train).append((enc.ids[: enc.prompt_len], c.answer))
        sizes.append(len(train) - before)
    if not all(sizes) or (cfg.val_fraction > 0 and not val):
        raise DataError(
            f"{', '.join(s.path for s in sources)}: {sizes} training and {len(val)} held-out prompts; both must be "
            "non-empty (data.val_fraction, data.seq_length; data.val_fraction 0: no held-out score)"
        )
    sampler = ResumableSampler(sizes, seed=seed, dp_rank=dp_rank, dp_size=dp_size, weights=[s.weight for s in sources])
    info = {
        "source": ", ".join(s.path for s in sources),
        "records": sum(len(s.items) for s in sources),
        "bad_records": len(bad),
        "bad_record_examples": bad[:10],
        "train_prompts": len(train),
        "val_prompts": len(val),
        "tokenizer_path": str(tokenizer.path),
        "tokenizer_source": "given",
        "chat_template": fmt.source if chat_template is not None else "data.template",
    }
    return PromptBundle(
        cfg,
        tokenizer.tokenizer,
        vocab_size or cfg.tokenizer.vocab_size,
        tokenizer.eos_id,
        fmt,
        train,
        val,
        sampler,
        info,
        [s.name for s in sources],
    )
