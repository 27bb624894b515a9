"""``build_sft_data``: instruction JSONL in, fixed-length training rows with loss masks out.

Each row holds ``seq_length + 1`` tokens (inputs and shifted targets), as pretraining rows do:

- ``input_ids``; ``labels``: the token where it is trained on, -100 elsewhere (never the first token
  of a sample, so a packed row never trains one sample's start on the end of the one before);
- ``position_ids``: restart at 0 for every sample;
- with ``data.packing``: ``segment_ids`` (1, 2, ... per sample, 0 for padding), from which the model
  builds a block-diagonal causal mask, so attention never crosses samples. Without packing each row
  holds one sample, right-padded: causal attention alone never lets a real token see the padding.

Samples longer than a row follow ``data.truncation`` (``truncate_prompt`` drops prompt tokens from the
left, never the final answer; ``drop``); one that still does not fit is a bad record (file and line).
"""

from __future__ import annotations

import bisect
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from canntrain_core.data.cache import DataError, key_of, resolve_cache_dir
from canntrain_core.data.corpus import list_inputs, listing_fingerprint
from canntrain_core.data.sampler import ResumableSampler, train_loader, val_share
from canntrain_core.data.tokenizer import TokenText, get_tokenizer
from canntrain_core.finetune.format import ChatFormat, Encoded
from canntrain_core.finetune.records import SourceRecords, is_val, read_conversations, read_sources

IGNORE = -100


@dataclass
class Sample:
    name: str
    enc: Encoded


class Rows(Dataset):
    """Fixed-length rows of dict tensors (see the module docstring)."""

    def __init__(self, rows: list[dict[str, torch.Tensor]]):
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.rows[i]


def fit_sample(s: Sample, length: int, policy: str) -> Encoded | str:
    """The sample cut to ``length`` tokens by the truncation policy, or why it cannot be."""
    e = s.enc
    n = len(e.ids)
    if n <= length:
        return e
    over = n - length
    if policy == "drop":
        return f"over-long: {n} tokens > {length} (data.seq_length + 1; data.truncation=drop)"
    if over > e.prompt_len:
        return (
            f"over-long: the final answer alone needs {n - e.prompt_len} tokens of {length} "
            "(answers are never truncated)"
        )
    return Encoded(e.ids[over:], e.trained[over:], e.prompt_len - over)


def real_tokens(rows: dict[str, torch.Tensor]) -> int:
    """Input tokens of a batch of rows that are not padding: a packed row's samples (``segment_ids`` > 0), a padded
    row's one sample (its positions run 0..n-1). Inputs are a row's first ``seq_length`` tokens."""
    if "segment_ids" in rows:
        return int((rows["segment_ids"][:, :-1] > 0).sum())
    return int((rows["position_ids"][:, :-1].amax(-1) + 1).sum())


def make_rows(samples: list[Encoded], length: int, pad_id: int, packing: bool) -> tuple[list[dict], dict]:
    """Pack (or pad) encoded samples into rows of ``length``; also the padding statistics.

    Packing is best-fit decreasing (TRL's ``packing_strategy="bfd"``): longest samples first, each into the row it
    fills most tightly, a new row when none has room. The rows keep the samples whole; the sampler shuffles the
    rows."""
    if not packing:
        groups = [[e] for e in samples]
    else:
        groups = []
        free: list[tuple[int, int]] = []  # (room left, row index), sorted: the tightest fit is the first with room
        for e in sorted(samples, key=lambda e: -len(e.ids)):
            at = bisect.bisect_left(free, (len(e.ids), -1))
            if at == len(free):
                groups.append([e])
                bisect.insort(free, (length - len(e.ids), len(groups) - 1))
            else:
                room, row = free.pop(at)
                groups[row].append(e)
                bisect.insort(free, (room - len(e.ids), row))
    rows = []
    real = 0
    for group in groups:
        ids, labels, pos, seg = [], [], [], []
        for k, e in enumerate(group, start=1):
            ids += e.ids
            labels += [IGNORE] + [t if m else IGNORE for t, m in zip(e.ids[1:], e.trained[1:])]
            pos += range(len(e.ids))
            seg += [k] * len(e.ids)
        real += len(ids)
        pad = length - len(ids)
        row = {"input_ids": ids + [pad_id] * pad, "labels": labels + [IGNORE] * pad, "position_ids": pos + [0] * pad}
        if packing:
            row["segment_ids"] = seg + [0] * pad
        rows.append({k: torch.tensor(v, dtype=torch.long) for k, v in row.items()})
    stats = {"rows": len(rows), "samples": len(samples), "padding_fraction": 1 - real / max(1, len(rows) * length)}
    return rows, stats


@dataclass
class SFTBundle(TokenText):
    """What the trainer and the notebooks need from instruction data (the pretraining bundle's interface)."""

    cfg: Any
    tokenizer: Any
    vocab_size: int
    eos_id: int
    format: ChatFormat
    train: Rows
    val: Rows | None
    sampler: ResumableSampler
    eval_examples: list[tuple[list[int], str]]  # held-out (prompt ids, expected answer) for exact match
    info: dict[str, Any] = field(default_factory=dict)
    names: list[str] = field(default_factory=list)  # each source's name (data.sources)

    def train_loader(self) -> DataLoader:
        return train_loader(self.train, self.sampler, self.cfg)

    def val_batches(self, n_samples: int, batch_size: int, dp_rank: int = 0, dp_size: int = 1) -> list[dict]:
        rows = len(self.val) if self.val is not None else 0
        share = val_share(
            rows, n_samples, batch_size, dp_rank, dp_size, "raise data.val_fraction or lower data.batch_size"
        )
        return [{k: torch.stack([self.val[i][k] for i in batch]) for k in self.val[0]} for batch in share]

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids


def build_sft_data(
    cfg,
    seed: int,
    dp_rank: int = 0,
    dp_size: int = 1,
    tokenizer=None,
    vocab_size: int | None = None,
    chat_template=None,
    model_type: str | None = None,
) -> SFTBundle:
    """Read ``cfg.source`` (JSONL), format, mask, truncate, split, pack; see the module docstring.

    ``tokenizer`` (a data.tokenizer.TrainedTokenizer) comes with the model (``model.init_from``); without
    one a byte-level BPE tokenizer is trained on the conversations. ``chat_template``: a transformers
    tokenizer whose chat template formats the text instead of ``cfg.template`` (both from
    ``data.tokenizer.pretrained_tokenizer``, which ``data.chat_template`` steers). ``model_type``: the model's,
    whose export a tokenizer trained here must suit.
    """
    start = time.perf_counter()
    sources = read_sources(cfg, lambda path: read_conversations(path, cfg.format, cfg.on_bad_record))
    given = tokenizer is not None
    if tokenizer is None:
        tokenizer = _train_tokenizer(sources, cfg, model_type)
        vocab_size = cfg.tokenizer.vocab_size
    vocab_size = vocab_size or cfg.tokenizer.vocab_size
    if tokenizer.tokenizer.get_vocab_size() > vocab_size:
        raise DataError(
            f"{tokenizer.path}: the tokenizer has {tokenizer.tokenizer.get_vocab_size()} tokens, more "
            f"than the model's {vocab_size} embedding rows (vocab_size)"
        )
    fmt = ChatFormat(tokenizer.tokenizer, tokenizer.eos_id, cfg.template, chat_template)
    length = cfg.seq_length + 1
    train_rows, val_rows, evals, bad = [], [], [], []
    sizes, samples, trained, real_fill = [], 0, 0, 0.0
    for src in sources:
        bad += src.bad
        splits: dict[str, list[Encoded]] = {"train": [], "val": []}
        for conv in src.items:
            fitted = fit_sample(Sample(conv.name, fmt.encode(conv, cfg.train_on)), length, cfg.truncation)
            if isinstance(fitted, str):
                if cfg.on_bad_record == "error":
                    raise DataError(f"{conv.where}: {fitted} (or set data.on_bad_record=skip)")
                bad.append(f"{conv.name}: {fitted}")
                continue
            split = "val" if is_val(conv.name, cfg.val_fraction) else "train"
            splits[split].append(fitted)
            if split == "val":
                evals.append((fitted.ids[: fitted.prompt_len], conv.answer))
        g = torch.Generator().manual_seed(seed)
        order = torch.randperm(len(splits["train"]), generator=g).tolist()  # packing neighbours: a fixed shuffle
        rows, stats = make_rows([splits["train"][i] for i in order], length, tokenizer.eos_id, cfg.packing)
        if not rows:
            raise DataError(f"{src.path}: no training rows ({len(src.bad)} record(s) left out)")
        train_rows += rows
        sizes.append(len(rows))
        samples += stats["samples"]
        real_fill += (1 - stats["padding_fraction"]) * len(rows)
        trained += sum(int((r["labels"] != IGNORE).sum()) for r in rows)
        if splits["val"]:
            val_rows += make_rows(splits["val"], length, tokenizer.eos_id, cfg.packing)[0]
    info = {
        "source": ", ".join(s.path for s in sources),
        "records": sum(len(s.items) for s in sources),
        "bad_records": len(bad),
        "bad_record_examples": bad[:10],
        "train_samples": samples,
        "train_rows": len(train_rows),
        "val_samples": len(evals),
        "val_rows": len(val_rows),
        "packing": cfg.packing,
        "padding_fraction": round(1 - real_fill / len(train_rows), 4),
        "trained_tokens_per_epoch": trained,
        "tokenizer_path": str(tokenizer.path),
        "tokenizer_source": "given" if given else "trained",
        "chat_template": fmt.source if chat_template is not None else "data.template",
        "total_seconds": round(time.perf_counter() - start, 3),
    }
    sampler = ResumableSampler(
        sizes,
        seed=seed,
        dp_rank=dp_rank,
        dp_size=dp_size,
        weights=[s.weight for s in sources] if len(sources) > 1 else None,
    )
    return SFTBundle(
        cfg,
        tokenizer.tokenizer,
        vocab_size,
        tokenizer.eos_id,
        fmt,
        Rows(train_rows),
        Rows(val_rows) if val_rows else None,
        sampler,
        evals,
        info,
        [s.name for s in sources],
    )


def _train_tokenizer(sources: list[SourceRecords], cfg, model_type: str | None):
    """A byte-level BPE tokenizer trained on the conversations themselves (no model to bring one)."""
    inputs = [i for s in sources for i in list_inputs(s.path)]
    key = key_of({"records": listing_fingerprint(inputs), "format": cfg.format})

    def texts() -> list[str]:
        return ["\n".join(t for _, t in c.turns) for s in sources for c in s.items]

    return get_tokenizer(key, texts, cfg.tokenizer, resolve_cache_dir(cfg.cache_dir), model_type)


def write_jsonl(path: str | Path, records: list[dict]) -> Path:
    """Write records one JSON object per line (the instruction data format build_sft_data reads)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    return path
