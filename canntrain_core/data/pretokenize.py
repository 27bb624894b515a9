"""Encode the corpus once into flat token files: ``train.bin`` / ``val.bin`` plus ``meta.json``.

Each document is followed by EOS, so packed samples see document boundaries. The train/val split
is by document and depends only on the document's name, so it is the same on every machine and
does not shift when other documents are added. The output directory is named by a hash of the
corpus contents, the tokenizer file and the split, is built in a temporary directory and renamed
into place, so a second run (or another rank) finds it complete or not at all.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from canntrain_core.data.cache import file_lock, key_of
from canntrain_core.data.corpus import Corpus, Document
from canntrain_core.data.tokenizer import TrainedTokenizer

FORMAT_VERSION = 1
_SPLIT_BUCKETS = 10_000
# Documents per encode_batch call: large enough for the Rust thread pool, small enough that
# the progress bar moves and memory stays bounded on the full stdlib.
_CHUNK_DOCS = 64


@dataclass(frozen=True)
class Pretokenized:
    dir: Path
    train_path: Path
    val_path: Path
    meta: dict
    cache_hit: bool
    seconds: float

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.meta["dtype"])


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 while every id fits (vocab_size <= 65535), else uint32: halves the files for small vocabs."""
    return np.dtype(np.uint16) if vocab_size <= 65535 else np.dtype(np.uint32)


def _bucket(name: str) -> int:
    return int(hashlib.sha256(name.encode("utf-8")).hexdigest(), 16) % _SPLIT_BUCKETS


def split_documents(docs: tuple[Document, ...], val_fraction: float) -> tuple[list[Document], list[Document]]:
    """Deterministic document-level split: a document goes to val when its name's bucket is low.

    With val_fraction > 0 and at least two documents, both splits are made non-empty by moving
    the document closest to the threshold, so a tiny corpus still has something to validate on.
    """
    threshold = val_fraction * _SPLIT_BUCKETS
    train = [d for d in docs if _bucket(d.name) >= threshold]
    val = [d for d in docs if _bucket(d.name) < threshold]
    if val_fraction > 0 and len(docs) >= 2:
        if not val:
            moved = min(train, key=lambda d: (_bucket(d.name), d.name))
            train.remove(moved)
            val.append(moved)
        elif not train:
            moved = max(val, key=lambda d: (_bucket(d.name), d.name))
            val.remove(moved)
            train.append(moved)
    return train, val


def pretokenize_cache_dir(
    corpus: Corpus, tok: TrainedTokenizer, vocab_size: int, val_fraction: float, cache_dir: Path
) -> Path:
    key = key_of(
        {
            "version": FORMAT_VERSION,
            "corpus": corpus.content_hash,
            "tokenizer": tok.sha256,
            "vocab_size": vocab_size,
            "val_fraction": val_fraction,
        }
    )
    return cache_dir / "pretokenized" / key


def pretokenize(
    corpus: Corpus, tok: TrainedTokenizer, vocab_size: int, val_fraction: float, cache_dir: Path
) -> Pretokenized:
    """Return the token files for (corpus, tokenizer, split), encoding them on a cache miss."""
    out = pretokenize_cache_dir(corpus, tok, vocab_size, val_fraction, cache_dir)
    start = time.perf_counter()
    with file_lock(out.with_name(out.name + ".lock")):
        hit = (out / "meta.json").is_file()
        if not hit:
            _build(corpus, tok, vocab_size, val_fraction, out)
    meta = json.loads((out / "meta.json").read_text(encoding="utf-8"))
    return Pretokenized(out, out / "train.bin", out / "val.bin", meta, hit, time.perf_counter() - start)


def _build(corpus: Corpus, tok: TrainedTokenizer, vocab_size: int, val_fraction: float, out: Path) -> None:
    dtype = token_dtype(vocab_size)
    if tok.tokenizer.get_vocab_size() > vocab_size:
        raise ValueError(f"tokenizer has {tok.tokenizer.get_vocab_size()} tokens, more than vocab_size={vocab_size}")
    train_docs, val_docs = split_documents(corpus.documents, val_fraction)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp"))
    # A literal "<|endoftext|>" inside a document is text, not a document boundary: only the
    # EOS we append separates documents. (The flag is not part of the tokenizer JSON.)
    tok.tokenizer.encode_special_tokens = True
    try:
        # tqdm's delay: the bar only appears if encoding takes more than a moment.
        with tqdm(total=corpus.n_bytes, unit="B", unit_scale=True, desc="pretokenize", delay=1.0) as bar:
            n_train = _encode_to(tmp / "train.bin", train_docs, tok, dtype, bar)
            n_val = _encode_to(tmp / "val.bin", val_docs, tok, dtype, bar)
        meta = {
            "format_version": FORMAT_VERSION,
            "dtype": dtype.name,
            "vocab_size": vocab_size,
            "eos_id": tok.eos_id,
            "train_tokens": n_train,
            "val_tokens": n_val,
            "train_documents": len(train_docs),
            "val_documents": len(val_docs),
            "val_fraction": val_fraction,
            "corpus_hash": corpus.content_hash,
            "corpus_files_hash": corpus.files_hash,
            "tokenizer_hash": tok.sha256,
            "tokenizer_path": str(tok.path),
        }
        # meta.json is written last: its presence marks a complete directory.
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
        if out.exists() and not (out / "meta.json").is_file():
            shutil.rmtree(out)  # an incomplete directory someone tampered with; we hold the lock
        try:
            os.rename(tmp, out)
        except OSError:
            if not (out / "meta.json").is_file():  # not a concurrent identical build: a real error
                raise
            shutil.rmtree(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        tok.tokenizer.encode_special_tokens = False


def _encode_to(path: Path, docs: list[Document], tok: TrainedTokenizer, dtype: np.dtype, bar: tqdm) -> int:
    """Append the token ids of `docs` (each followed by EOS) to `path`; return the token count."""
    n = 0
    with open(path, "wb") as f:
        for i in range(0, len(docs), _CHUNK_DOCS):
            chunk = docs[i : i + _CHUNK_DOCS]
            encodings = tok.tokenizer.encode_batch([d.text for d in chunk], add_special_tokens=False)
            for enc in encodings:
                ids = np.asarray(enc.ids + [tok.eos_id], dtype=dtype)
                ids.tofile(f)
                n += ids.size
            bar.update(sum(d.n_bytes for d in chunk))
        f.flush()
        os.fsync(f.fileno())
    return n
