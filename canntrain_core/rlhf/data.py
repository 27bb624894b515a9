"""Alignment data: preference pairs and prompts, encoded with the fine-tuning chat format.

- pairs (reward model, DPO): ``{"prompt": ..., "chosen": ..., "rejected": ...}`` per line;
- prompts (PPO, GRPO): the fine-tuning records themselves (alpaca/messages/ShareGPT); the final
  answer is kept as the reference the programmatic scorer compares a generated answer with.

A bad line is named by file and line, or skipped and counted (``data.on_bad_record``).
:func:`preference_records` makes pairs for the verifiable task whose order the scorer decides.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from canntrain_core.data.cache import DataError
from canntrain_core.finetune.format import ChatFormat
from canntrain_core.finetune.records import BadRecord, Conversation, read_conversations
from canntrain_core.finetune.tasks import KINDS, make_item, partial_score


@dataclass(frozen=True)
class Pair:
    name: str
    prompt: str
    chosen: str
    rejected: str


def read_pairs(path: str | Path, on_bad_record: str = "error") -> tuple[list[Pair], list[str]]:
    path = Path(path)
    if not path.is_file():
        raise DataError(f"data.source: {path} does not exist (preference pairs are a .jsonl file)")
    out, bad = [], []
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                try:
                    rec = json.loads(raw.decode("utf-8"))
                except (UnicodeDecodeError, json.JSONDecodeError) as e:
                    raise BadRecord(f"not a JSON line ({e})") from None
                if not isinstance(rec, dict) or not all(isinstance(rec.get(k), str) for k in ("prompt", "chosen", "rejected")):
                    raise BadRecord("a preference pair needs strings 'prompt', 'chosen' and 'rejected'")
                if not rec["chosen"].strip() or not rec["rejected"].strip():
                    raise BadRecord("empty chosen or rejected answer")
                out.append(Pair(f"{path.name}:{lineno}", rec["prompt"], rec["chosen"], rec["rejected"]))
            except BadRecord as e:
                if on_bad_record == "error":
                    raise DataError(f"{path}, line {lineno}: {e} (or set data.on_bad_record=skip)") from None
                bad.append(f"{path.name}:{lineno}: {e}")
    if not out:
        raise DataError(f"{path}: no usable preference pairs ({len(bad)} left out)")
    return out, bad


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


def read_prompts(path: str | Path, fmt_name: str = "auto", on_bad_record: str = "error"
                 ) -> tuple[list[Conversation], list[str]]:
    """Conversations whose final answer is the scorer's reference."""
    return read_conversations(path, fmt_name, on_bad_record)


def preference_records(n: int, seed: int = 0, kinds: tuple[str, ...] = KINDS) -> list[dict]:
    """``n`` pairs for the verifiable task: the correct answer, and a corrupted one the scorer ranks lower
    (one item changed or two swapped), so a reward model trained on them learns the true score's order."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt, answer = make_item(kinds[i % len(kinds)], rng)
        items = answer.split(" ")
        while True:
            wrong = list(items)
            if len(wrong) > 1 and rng.random() < 0.5:
                a, b = rng.sample(range(len(wrong)), 2)
                wrong[a], wrong[b] = wrong[b], wrong[a]
            else:
                k = rng.randrange(len(wrong))
                pool = "0123456789" if wrong[k].isdigit() else "abcdefghijklmnopqrstuvwxyz"
                wrong[k] = rng.choice(pool.upper() if wrong[k].isupper() else pool)
            if partial_score(" ".join(wrong), answer) < 1.0:
                break
        out.append({"prompt": prompt, "chosen": answer, "rejected": " ".join(wrong)})
    return out
