"""``build_data``: the recipe's ``data`` section in, tokenizer + packed datasets + resumable sampler out.

One data path. Every source is prepared data when training reads it (``data/prepared.py``): a dataset
``canntrain prepare`` wrote, Megatron's ``.bin``/``.idx``, or a raw source (the stdlib, a directory, record
files) that is prepared in this process on first use, into the cache, by the same code as ``canntrain prepare``
(keyed by the sources' listing, sizes and modification times, so a later start only lists and stats them).

The tokenizer is, in order: ``model.init_from``'s, ``data.tokenizer.path``, the prepared sources' own, or a
byte-level BPE trained on a sample of the raw sources. Whatever names one must agree with the others (a prepared
dataset's ids mean its tokenizer's tokens): a disagreement is one line naming both.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tokenizers import Tokenizer
from torch.utils.data import ConcatDataset, DataLoader

from canntrain_core.data.cache import DataError, file_lock, key_of, resolve_cache_dir
from canntrain_core.data.corpus import BadRecords, list_inputs, listing_fingerprint, make_units, sample_texts, select
from canntrain_core.data.prepare import VERSION, PrepareOptions, default_unit_bytes, prepare, remove_incomplete
from canntrain_core.data.prepared import (
    PreparedData,
    TokenWindows,
    is_prepared,
    open_prepared,
    read_manifest,
    split_streams,
)
from canntrain_core.data.sampler import ResumableSampler, train_loader, val_share
from canntrain_core.data.tokenizer import (
    TokenText,
    TrainedTokenizer,
    get_tokenizer,
    load_tokenizer_dir,
    resolved_vocab_size,
)
from canntrain_core.recipe import DataConfig

VAL_SEED = 0  # the validation set is the same whatever experiment.seed


@dataclass
class DataBundle(TokenText):
    """Everything a trainer and a notebook need from the data side."""

    cfg: DataConfig
    tokenizer: Tokenizer
    vocab_size: int  # the model's embedding rows (>= the tokenizer's own size)
    eos_id: int
    train: ConcatDataset  # the sources' train windows, in data.sources order
    val: ConcatDataset | None  # None only when data.val_fraction == 0
    sampler: ResumableSampler
    names: list[str]  # each source's name (metrics: tokens/<name>)
    info: dict[str, Any] = field(default_factory=dict)

    def train_loader(self) -> DataLoader:
        """Infinite loader of [batch_size, seq_length+1] LongTensors (``data.sampler.train_loader``)."""
        return train_loader(self.train, self.sampler, self.cfg)

    def val_batches(self, n_samples: int, batch_size: int, dp_rank: int = 0, dp_size: int = 1) -> list[torch.Tensor]:
        """This data-parallel rank's share of the first ``n_samples`` validation samples (drawn from the sources
        by their weights, in a fixed order), in batches; the same tensors on every call."""
        rows = len(self.val) if self.val is not None else 0
        share = val_share(
            rows,
            n_samples,
            batch_size,
            dp_rank,
            dp_size,
            "give more data (data.max_bytes) or a larger data.val_fraction, or lower data.batch_size",
        )
        if not share:
            return []
        order = ResumableSampler([len(d) for d in self.val.datasets], VAL_SEED, weights=self.sampler.weights)
        return [torch.stack([self.val[int(i)] for i in order.indices(np.asarray(batch))]) for batch in share]

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` (no EOS appended; a literal special token in a prompt does become that token,
        whereas prepared training data keeps it as plain text)."""
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def tokens_per_source(self) -> dict[str, int]:
        """Training tokens the whole job has drawn from each source so far."""
        L = self.cfg.seq_length
        return {n: c * L for n, c in zip(self.names, self.sampler.consumed_per_source())}


def model_vocab_size(cfg: DataConfig) -> int:
    """The model's embedding rows, known before the data is built (the model is built first): data.tokenizer.vocab_size
    when the recipe sets it, else the size of the tokenizer data.tokenizer.path or the first prepared source names
    (its manifest), else the default for a tokenizer trained here. A path that does not exist yet leaves the
    recipe's value (building the data then says what is missing)."""
    size = None
    if cfg.tokenizer.path is not None:
        path = Path(cfg.tokenizer.path).expanduser()
        if path.is_dir():
            size = load_tokenizer_dir(path, what="data.tokenizer.path").tokenizer.get_vocab_size()
    else:
        try:
            mixture = cfg.mixture
        except ValueError:
            mixture = []
        manifests = (read_manifest(s.path) for s in mixture)
        size = next((m["tokenizer"]["vocab_size"] for m in manifests if m is not None), None)
    return resolved_vocab_size(cfg, size)


def epochs_summary(bundle: DataBundle, draws: int) -> str:
    """One line: each source's share of ``draws`` training samples and the passes over it they make; a source
    repeated more than ``data.max_source_epochs`` times is refused (before training)."""
    epochs = bundle.sampler.epochs_per_source(draws)
    counts = bundle.sampler.mixture.counts(draws)
    parts = [f"{n} {c / max(draws, 1):.0%} of samples, {e:.2f} epochs" for n, c, e in zip(bundle.names, counts, epochs)]
    limit = bundle.cfg.max_source_epochs
    over = [(n, e) for n, e in zip(bundle.names, epochs) if limit is not None and e > limit]
    if over:
        name, e = over[0]
        raise DataError(
            f"data.max_source_epochs={limit:g}: source {name} would be drawn {e:.2f} times over in {draws} samples; "
            "give it a lower weight or more data, or raise data.max_source_epochs"
        )
    return "data: " + "; ".join(parts)


def drawn_per_source(bundle) -> dict[str, int]:
    """What a mixture's metrics row says of each source: training tokens drawn so far (pretraining, whose samples
    are all seq_length tokens), or rows drawn (instruction and preference data)."""
    if isinstance(bundle, DataBundle):
        return {f"tokens/{n}": t for n, t in bundle.tokens_per_source().items()}
    return {f"samples/{n}": c for n, c in zip(bundle.names, bundle.sampler.consumed_per_source())}


def source_names(cfg: DataConfig) -> list[str]:
    names = [s.name or Path(s.path.rstrip("/")).name or s.path for s in cfg.mixture]
    if len(set(names)) != len(names):
        raise DataError(f"data.sources: two sources share a name ({names}); give each a name")
    return names


def build_data(
    cfg: DataConfig,
    seed: int,
    dp_rank: int = 0,
    dp_size: int = 1,
    tokenizer: TrainedTokenizer | None = None,
    vocab_size: int | None = None,
    model_type: str | None = None,
) -> DataBundle:
    """Open (preparing raw sources on first use) the data of ``cfg``; see the module docstring.

    ``tokenizer``: one that came with a pretrained model (``model.init_from``); ``vocab_size``: the model's
    embedding rows when they do not come from ``data.tokenizer`` (init_from); ``model_type``: the model's, whose
    export a tokenizer trained here must suit (``data.tokenizer.transformers_pipeline``)."""
    start = time.perf_counter()
    try:
        mixture = cfg.mixture
    except ValueError as e:
        raise DataError(str(e)) from None
    names = source_names(cfg)
    cache_dir = resolve_cache_dir(cfg.cache_dir)
    named = _named_tokenizer(cfg, tokenizer)
    named_source = "given" if tokenizer is not None else "path" if named is not None else None
    ready = {k: open_prepared(s.path) for k, s in enumerate(mixture) if is_prepared(s.path)}
    if ready and (cfg.max_bytes or cfg.max_files):
        k = next(iter(ready))
        raise DataError(
            f"data.max_bytes / data.max_files cut a raw corpus; {mixture[k].path} is prepared and is used whole"
        )
    tok, tokenizer_source = _choose_tokenizer(cfg, mixture, named, named_source, ready, cache_dir, model_type)
    raw_stats = {}
    for k, s in enumerate(mixture):
        if k not in ready:
            ready[k], raw_stats[k] = _prepare_raw(s.path, cfg, tok, cache_dir)
    datasets = [ready[k] for k in range(len(mixture))]
    own_size = tok.tokenizer.get_vocab_size()
    if vocab_size is not None:
        if vocab_size < own_size:
            raise DataError(
                f"{tok.path}: the tokenizer has {own_size} tokens, more than the model's {vocab_size} embedding rows"
            )
        rows = vocab_size
    else:
        rows = resolved_vocab_size(cfg, own_size if tokenizer_source != "trained" else None)
        if rows < own_size:
            raise DataError(
                f"{tok.path}: the tokenizer has {own_size} tokens, more than the model's {rows} embedding rows "
                "(data.tokenizer.vocab_size)"
            )

    trains, vals, per_source = [], [], []
    for k, (name, s, d) in enumerate(zip(names, mixture, datasets)):
        train_stream, val_stream = split_streams(d, cfg.val_fraction, cache_dir)
        train = TokenWindows(train_stream, cfg.seq_length, "train", s.path)
        trains.append(train)
        if val_stream is not None:
            vals.append(TokenWindows(val_stream, cfg.seq_length, "val", s.path))
        per_source.append(
            {
                "name": name,
                "path": s.path,
                "weight": s.weight,
                "prepared": str(d.path),
                "fingerprint": d.fingerprint,
                "documents": d.n_documents,
                "tokens": d.n_tokens,
                "train_samples": len(train),
                "val_samples": len(vals[-1]) if val_stream is not None else 0,
                **raw_stats.get(k, {}),
            }
        )
    weights = [s.weight for s in mixture]
    sampler = ResumableSampler(
        [len(t) for t in trains],
        seed=seed,
        dp_rank=dp_rank,
        dp_size=dp_size,
        weights=weights,
        sources=[(n, d.fingerprint) for n, d in zip(names, datasets)],
    )
    bad = sum(r.get("bad_records", 0) for r in per_source)
    info = {
        "sources": per_source,
        "tokenizer_source": tokenizer_source,
        "tokenizer_path": str(tok.path),
        "tokenizer_hash": tok.sha256,
        "tokenizer_cache_hit": tok.cache_hit,
        "tokenizer_seconds": round(tok.seconds, 3),
        "tokenizer_size": own_size,
        "vocab_size": rows,
        "documents": sum(d.n_documents for d in datasets),
        "train_tokens": sum(t.n_tokens for t in trains),
        "val_tokens": sum(v.n_tokens for v in vals),
        "train_samples": sum(len(t) for t in trains),
        "val_samples": sum(len(v) for v in vals),
        "samples_per_epoch_per_rank": sampler.samples_per_epoch,
        "prepare_cache_hit": all(r.get("cache_hit", True) for r in per_source),
        "bad_records": bad,
        "bad_record_examples": [e for r in per_source for e in r.get("bad_record_examples", [])][:10],
        "total_seconds": round(time.perf_counter() - start, 3),
    }
    return DataBundle(
        cfg=cfg,
        tokenizer=tok.tokenizer,
        vocab_size=rows,
        eos_id=tok.eos_id,
        train=ConcatDataset(trains),
        val=ConcatDataset(vals) if vals else None,
        sampler=sampler,
        names=names,
        info=info,
    )


def _named_tokenizer(cfg: DataConfig, given: TrainedTokenizer | None) -> TrainedTokenizer | None:
    """model.init_from's tokenizer and/or data.tokenizer.path's; when both, they must be the same."""
    if cfg.tokenizer.path is None:
        return given
    path = Path(cfg.tokenizer.path).expanduser()
    if not path.exists():
        raise DataError(
            f"data.tokenizer.path: {cfg.tokenizer.path} does not exist; put the model's tokenizer there "
            "(tokenizer.json "
            "or tokenizer.model), then prepare the corpus with it: canntrain prepare SOURCE --tokenizer "
            f"{cfg.tokenizer.path} -o DATASET_DIR"
        )
    own = load_tokenizer_dir(path, what="data.tokenizer.path")
    if given is not None and given.sha256 != own.sha256:
        raise DataError(
            f"data.tokenizer.path {path} and model.init_from's tokenizer ({given.path}) differ; the model's "
            "embeddings mean its own tokens: leave data.tokenizer.path out"
        )
    return given or own


def _choose_tokenizer(
    cfg, mixture, named, named_source, ready, cache_dir, model_type=None
) -> tuple[TrainedTokenizer, str]:
    """(tokenizer, where it came from): see the module docstring."""
    prepared = {k: d for k, d in ready.items() if d.tokenizer_sha256 is not None}
    reference = named
    for k, d in prepared.items():
        if reference is None:
            reference = load_tokenizer_dir(d.tokenizer_dir, what=str(d.tokenizer_dir))
        elif d.tokenizer_sha256 != reference.sha256:
            raise DataError(
                f"{mixture[k].path} was prepared with another tokenizer than {reference.path}: its token ids mean "
                f"other tokens; prepare it again with --tokenizer {reference.directory}"
            )
    foreign = [mixture[k].path for k, d in ready.items() if d.tokenizer_sha256 is None]
    if foreign and reference is None:
        raise DataError(
            f"{foreign[0]}: Megatron data carries no tokenizer; name the one it was made with in data.tokenizer.path"
        )
    if reference is not None:
        return reference, named_source or "prepared"
    return _trained_tokenizer(cfg, mixture, cache_dir, model_type), "trained"


def _raw_inputs(path: str, cfg: DataConfig):
    what = "data.source" if cfg.sources is None else f"data.sources (path {path})"
    return select(list_inputs(path, what), cfg.max_bytes, cfg.max_files)


def _trained_tokenizer(cfg: DataConfig, mixture, cache_dir: Path, model_type: str | None) -> TrainedTokenizer:
    """A byte-level BPE trained on a sample of the raw sources, cached under their listing (not their text)."""
    listed = [(s.path, _raw_inputs(s.path, cfg)) for s in mixture]
    key = key_of(
        {
            "sources": [[p, listing_fingerprint(inputs)] for p, inputs in listed],
            "text_field": cfg.text_field,
            "max_bytes": cfg.max_bytes,
        }
    )

    def texts() -> list[str]:
        out: list[str] = []
        budget = min(cfg.tokenizer.sample_bytes, cfg.max_bytes or cfg.tokenizer.sample_bytes)
        bad = BadRecords(cfg.on_bad_record)
        for path, inputs in listed:
            units = make_units(inputs, default_unit_bytes(sum(i.size for i in inputs)))
            out += sample_texts(
                inputs, units, cfg.text_field, BadRecords("skip") if path == "stdlib" else bad, budget // len(listed)
            ).texts
        if not out:
            skipped = f": skipped {bad.count} bad record(s): {'; '.join(bad.examples[:3])}" if bad.count else ""
            raise DataError(f"data.source: no usable documents in {', '.join(p for p, _ in listed)}{skipped}")
        return out

    return get_tokenizer(key, texts, cfg.tokenizer, cache_dir, model_type)


def _prepare_raw(path: str, cfg: DataConfig, tok: TrainedTokenizer, cache_dir: Path) -> tuple[PreparedData, dict]:
    """A raw source prepared into the cache on first use (one process: tiny corpora; a large one is prepared
    with ``canntrain prepare --workers N`` instead), opened on later starts after a listing."""
    opts = PrepareOptions(
        text_field=cfg.text_field,
        on_bad_record="skip" if path == "stdlib" else cfg.on_bad_record,  # the stdlib's non-UTF-8 test files
        max_bytes=cfg.max_bytes,
        max_files=cfg.max_files,
    )
    inputs = _raw_inputs(path, cfg)
    key = key_of(
        {
            "version": VERSION,
            "source": path,
            "listing": listing_fingerprint(inputs),
            "settings": opts.settings() | {"max_bytes": opts.max_bytes, "max_files": opts.max_files},
            "tokenizer": tok.sha256,
        }
    )
    out = cache_dir / "prepared" / key
    start = time.perf_counter()
    hit = (out / "manifest.json").is_file()
    if not hit:
        with file_lock(out.with_name(out.name + ".lock")):
            try:
                result = prepare([path], out, tokenizer=tok, opts=opts)
            except DataError:
                remove_incomplete(out)
                raise
            hit = result.cache_hit
    data = open_prepared(out)
    m = data.manifest
    stats = {
        "cache_hit": hit,
        "prepare_seconds": round(time.perf_counter() - start, 3),
        "text_bytes": m["text_bytes"],
        "bad_records": m["bad_records"],
        "bad_record_examples": m["bad_record_examples"],
    }
    return data, stats
