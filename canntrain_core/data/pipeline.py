"""``build_data``: recipe ``data`` section in, tokenizer + packed datasets + resumable sampler out.

corpus -> tokenizer (trained or cached) -> pretokenized train/val files (built or cached)
       -> PackedDataset per split -> ResumableSampler over train. One call, cached steps, so a
notebook can rerun its data cell freely and every rank of a torchrun job gets the same bytes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
from tokenizers import Tokenizer
from torch.utils.data import DataLoader

from canntrain_core.data.cache import DataError, resolve_cache_dir
from canntrain_core.data.corpus import load_corpus
from canntrain_core.data.dataset import PackedDataset
from canntrain_core.data.pretokenize import pretokenize
from canntrain_core.data.sampler import ResumableSampler, val_share
from canntrain_core.data.tokenizer import TrainedTokenizer, get_tokenizer
from canntrain_core.recipe import DataConfig
from canntrain_core.data.tokenizer import TokenText


@dataclass
class DataBundle(TokenText):
    """Everything a trainer and a notebook need from the data side."""

    cfg: DataConfig
    tokenizer: Tokenizer
    vocab_size: int  # == cfg.tokenizer.vocab_size: the model's embedding rows (>= tokenizer's own size)
    eos_id: int
    train: PackedDataset
    val: PackedDataset | None  # None only when data.val_fraction == 0
    sampler: ResumableSampler
    info: dict[str, Any] = field(default_factory=dict)

    def train_loader(self) -> DataLoader:
        """Infinite loader of [batch_size, seq_length+1] LongTensors in sampler order.

        The sampler is not advanced by iteration: call ``bundle.sampler.advance(batch_size)`` after
        each consumed micro-batch, so a checkpoint records what was trained on, not what was prefetched.
        """
        return DataLoader(
            self.train,
            batch_size=self.cfg.batch_size,
            sampler=self.sampler,
            num_workers=self.cfg.num_workers,
            persistent_workers=self.cfg.persistent_workers,
            pin_memory=False,
            drop_last=True,
        )

    def val_batches(self, n_samples: int, batch_size: int, dp_rank: int = 0, dp_size: int = 1) -> list[torch.Tensor]:
        """This data-parallel rank's share of the first ``n_samples`` validation samples, in batches
        (``data.sampler.val_share``); the same tensors on every call."""
        share = val_share(
            len(self.val) if self.val is not None else 0,
            n_samples,
            batch_size,
            dp_rank,
            dp_size,
            "raise data.max_bytes or data.val_fraction, or lower data.batch_size",
        )
        return [torch.stack([self.val[i] for i in batch]) for batch in share]

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` (no EOS appended; a literal <|endoftext|> in a prompt does become EOS,
        whereas pretokenized training data keeps it as plain text)."""
        return self.tokenizer.encode(text, add_special_tokens=False).ids


def build_data(
    cfg: DataConfig,
    seed: int,
    dp_rank: int = 0,
    dp_size: int = 1,
    tokenizer: TrainedTokenizer | None = None,
    vocab_size: int | None = None,
) -> DataBundle:
    """Build (or load from cache) the tokenizer and token files for `cfg`; see the module docstring.

    ``tokenizer``: one that came with a pretrained model (``model.init_from``), used instead of
    training one; ``vocab_size``: the model's embedding rows when they do not come from
    ``cfg.tokenizer.vocab_size`` (init_from).
    """
    start = time.perf_counter()
    if vocab_size is not None:
        cfg = cfg.model_copy(update={"tokenizer": cfg.tokenizer.model_copy(update={"vocab_size": vocab_size})})
    cache_dir = resolve_cache_dir(cfg.cache_dir)
    corpus = load_corpus(
        cfg.source,
        text_field=cfg.text_field,
        max_bytes=cfg.max_bytes,
        max_files=cfg.max_files,
        on_bad_record=cfg.on_bad_record,
    )
    tok = tokenizer or get_tokenizer(corpus, cfg.tokenizer, cache_dir)
    if tok.tokenizer.get_vocab_size() > cfg.tokenizer.vocab_size:
        raise DataError(
            f"{tok.path}: the tokenizer has {tok.tokenizer.get_vocab_size()} tokens, more than the "
            f"model's {cfg.tokenizer.vocab_size} embedding rows (vocab_size)"
        )
    pre = pretokenize(corpus, tok, cfg.tokenizer.vocab_size, cfg.val_fraction, cache_dir)
    meta = pre.meta

    train = PackedDataset(pre.train_path, pre.dtype, cfg.seq_length, split="train")
    val = None
    if cfg.val_fraction > 0:
        if meta["val_tokens"] == 0:
            raise DataError(
                f"the val split is empty ({corpus.n_documents} document(s)); val needs at least two "
                "documents: raise data.max_bytes / data.max_files, or set data.val_fraction to 0"
            )
        val = PackedDataset(pre.val_path, pre.dtype, cfg.seq_length, split="val")
    sampler = ResumableSampler(len(train), seed=seed, dp_rank=dp_rank, dp_size=dp_size)

    info = {
        "corpus_source": corpus.source,
        "corpus_documents": corpus.n_documents,
        "corpus_bytes": corpus.n_bytes,
        "corpus_files_hash": corpus.files_hash,
        "corpus_hash": corpus.content_hash,
        # Records / files left out as not usable text (data.on_bad_record), with the first few named.
        "bad_records": len(corpus.bad_records),
        "bad_record_examples": list(corpus.bad_records[:10]),
        "tokenizer_source": "given" if tokenizer is not None else "trained",
        "tokenizer_path": str(tok.path),
        "tokenizer_hash": tok.sha256,
        "tokenizer_cache_hit": tok.cache_hit,
        "tokenizer_seconds": round(tok.seconds, 3),
        "tokenizer_trained_vocab": tok.tokenizer.get_vocab_size(),
        "vocab_size": cfg.tokenizer.vocab_size,
        "pretokenize_dir": str(pre.dir),
        "pretokenize_cache_hit": pre.cache_hit,
        "pretokenize_seconds": round(pre.seconds, 3),
        "dtype": meta["dtype"],
        "train_documents": meta["train_documents"],
        "val_documents": meta["val_documents"],
        "train_tokens": meta["train_tokens"],
        "val_tokens": meta["val_tokens"],
        "train_samples": len(train),
        "val_samples": len(val) if val is not None else 0,
        "samples_per_epoch_per_rank": sampler.samples_per_epoch,
        "total_seconds": round(time.perf_counter() - start, 3),
    }
    return DataBundle(
        cfg=cfg,
        tokenizer=tok.tokenizer,
        vocab_size=cfg.tokenizer.vocab_size,
        eos_id=tok.eos_id,
        train=train,
        val=val,
        sampler=sampler,
        info=info,
    )
