"""Reading prepared data at training time: open a prepared dataset (or Megatron's own ``.bin``/``.idx``), split
its documents into train and val, and serve packed windows. Opening reads a manifest and index headers; no
document is read, hashed or listed per sample.

A split is the token stream of its documents, back to back. Document ``d`` of the dataset (counted across
shards) goes to val when ``unit_hash(d) < data.val_fraction``: a spread-out, seed-independent set that does not
depend on how the data was sharded. With ``val_fraction`` 0 the train split is the whole stream and nothing is
built. Otherwise the split is stored as *runs* (maximal stretches of consecutive documents of one split): two
int64 and one int32 per run, cached as a file under ``data.cache_dir`` keyed by the dataset's fingerprint and
the fraction, built once by reading the index's document offsets (12 bytes a document) and mapped afterwards.

Sample ``i`` of a split is the window ``[i*L, i*L + L + 1)`` of its stream (L = seq_length): L+1 tokens so the
trainer takes inputs ``x[:-1]`` and targets ``x[1:]``, and consecutive samples share one boundary token.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from canntrain_core.data.cache import DataError, file_lock, key_of
from canntrain_core.data.indexed import IndexedTokens, bin_path, idx_path
from canntrain_core.data.order import unit_hash
from canntrain_core.data.prepare import FORMAT, MANIFEST

SPLIT_VERSION = 1
_SPLIT_SALT = 0x5EED_0F_7A1


@dataclass
class PreparedData:
    """The shards of one prepared dataset, in order, with what identifies it."""

    path: Path
    shards: list[IndexedTokens]
    fingerprint: str
    tokenizer_dir: Path | None  # None: Megatron data brought without one (data.tokenizer.path names it)
    tokenizer_sha256: str | None
    manifest: dict | None

    @property
    def n_tokens(self) -> int:
        return sum(s.n_tokens for s in self.shards)

    @property
    def n_documents(self) -> int:
        return sum(s.n_documents for s in self.shards)

    @property
    def dtype(self) -> np.dtype:
        return self.shards[0].dtype


def is_prepared(path: str | Path) -> bool:
    """A prepared dataset or Megatron data: a directory with a manifest or ``.idx`` files, or a prefix."""
    p = Path(path).expanduser()
    if p.is_dir():
        return (p / MANIFEST).is_file() or any(p.glob("*.idx"))
    return idx_path(p).is_file() or (p.suffix in (".idx", ".bin") and p.is_file())


def read_manifest(path: str | Path) -> dict | None:
    """The manifest of the prepared dataset at ``path`` (None: not a canntrain prepared dataset)."""
    p = Path(path).expanduser() / MANIFEST
    if not p.is_file():
        return None
    try:
        manifest = json.loads(p.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError):
        raise DataError(f"{p}: not a JSON manifest (a preparation that did not finish? run it again)") from None
    if manifest.get("format") != FORMAT:
        raise DataError(f"{p}: not a canntrain prepared dataset (format {manifest.get('format')!r})")
    return manifest


def open_prepared(path: str | Path) -> PreparedData:
    """Open a prepared dataset directory, a directory of Megatron ``.bin``/``.idx`` pairs, or one prefix."""
    p = Path(path).expanduser().resolve()
    if p.suffix in (".idx", ".bin") and p.is_file():
        p = p.with_suffix("")
    manifest = read_manifest(p) if p.is_dir() else None
    if manifest is not None:
        shards = [IndexedTokens(p / s["prefix"]) for s in manifest["shards"]]
        for s, meta in zip(shards, manifest["shards"]):
            if s.n_tokens != meta["tokens"]:
                raise DataError(f"{bin_path(s.prefix)}: {s.n_tokens} tokens, the manifest says {meta['tokens']}")
        tok = p / manifest["tokenizer"]["dir"]
        return PreparedData(p, shards, manifest["fingerprint"], tok, manifest["tokenizer"]["sha256"], manifest)
    if p.is_dir():
        prefixes = sorted(q.with_suffix("") for q in p.glob("*.idx"))
        if not prefixes:
            raise DataError(f"{p}: neither a prepared dataset ({MANIFEST}) nor Megatron .bin/.idx files")
    elif idx_path(p).is_file():
        prefixes = [p]
    else:
        raise DataError(f"{p}: not prepared data (a canntrain prepare directory or a Megatron .bin/.idx prefix)")
    shards = [IndexedTokens(q) for q in prefixes]
    return PreparedData(p, shards, _foreign_fingerprint(shards), None, None, None)


def _foreign_fingerprint(shards: list[IndexedTokens]) -> str:
    """Megatron data has no manifest: its sizes and the first and last MiB of each index identify it, read
    in milliseconds whatever the corpus's size."""
    h = hashlib.sha256()
    for s in shards:
        p = idx_path(s.prefix)
        size = p.stat().st_size
        h.update(f"{s.prefix.name}\t{size}\t{bin_path(s.prefix).stat().st_size}\n".encode())
        with open(p, "rb") as f:
            h.update(f.read(1 << 20))
            f.seek(max(size - (1 << 20), 0))
            h.update(f.read(1 << 20))
    return h.hexdigest()


class SplitStream:
    """The token stream of one split: runs of (shard, start token), run ``r`` at stream offsets
    ``[offset[r], offset[r+1])``; ``read(a, n)`` any stretch. The arrays may be memory-mapped cache files."""

    def __init__(self, data: PreparedData, shard: np.ndarray, start: np.ndarray, offset: np.ndarray):
        self.data = data
        self.run_shard, self.run_start, self.run_offset = shard, start, offset
        self.n_tokens = int(offset[-1])

    def read(self, a: int, n: int) -> np.ndarray:
        out = np.empty(n, dtype=np.int64)
        r = int(np.searchsorted(self.run_offset, a, side="right")) - 1
        filled = 0
        while filled < n:
            within = a + filled - int(self.run_offset[r])
            take = min(n - filled, int(self.run_offset[r + 1] - self.run_offset[r]) - within)
            shard = self.data.shards[int(self.run_shard[r])]
            lo = int(self.run_start[r]) + within
            out[filled : filled + take] = shard.tokens[lo : lo + take]
            filled += take
            r += 1
        return out


def split_streams(data: PreparedData, val_fraction: float, cache_dir: Path) -> tuple[SplitStream, SplitStream | None]:
    """(train, val) streams of ``data`` (see the module docstring); val None when ``val_fraction`` is 0."""
    sizes = np.array([s.n_tokens for s in data.shards], dtype=np.int64)
    if val_fraction == 0:
        keep = sizes > 0
        n = int(keep.sum())
        offset = np.concatenate([[0], np.cumsum(sizes[keep])])
        return SplitStream(data, np.flatnonzero(keep), np.zeros(n, dtype=np.int64), offset), None
    key = key_of({"fingerprint": data.fingerprint, "val_fraction": val_fraction, "version": SPLIT_VERSION})
    where = cache_dir / "splits" / key
    with file_lock(where.with_name(where.name + ".lock")):
        if not (where / "done").is_file():
            tmp = where.with_name(f".{where.name}.tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            for name, array in _split_runs(data, val_fraction).items():
                np.save(tmp / f"{name}.npy", array)
            (tmp / "done").write_text("")
            shutil.rmtree(where, ignore_errors=True)
            tmp.rename(where)
    streams = []
    for split in ("train", "val"):
        shard, start, offset = (
            np.load(where / f"{split}_{k}.npy", mmap_mode="r") for k in ("shard", "start", "offset")
        )
        streams.append(SplitStream(data, shard, start, offset))
    return streams[0], streams[1]


def _doc_lengths(s: IndexedTokens) -> np.ndarray:
    starts = s.document_starts()
    return np.diff(np.append(starts, s.n_tokens))


def _val_threshold(data: PreparedData, val_fraction: float) -> float:
    """The hash below which documents go to val so that they hold ``val_fraction`` of the tokens (the first
    document that reaches it included): a histogram of hashes weighted by length, then the one bin that crosses
    the share sorted exactly. Streams over the shards; memory is the histogram's, never a document's list."""
    bins = 1 << 16
    hist = np.zeros(bins, dtype=np.int64)
    for s, h in _hashes(data):
        hist += np.bincount(np.minimum((h * bins).astype(np.int64), bins - 1), _doc_lengths(s), bins).astype(np.int64)
    want = val_fraction * int(hist.sum())
    cum = np.cumsum(hist)
    b = int(np.searchsorted(cum, want, side="left"))
    before = int(cum[b - 1]) if b > 0 else 0
    inside: list[tuple[float, int]] = []
    for s, h in _hashes(data):
        sel = np.minimum((h * bins).astype(np.int64), bins - 1) == b
        inside += zip(h[sel].tolist(), _doc_lengths(s)[sel].tolist())
    for h, n in sorted(inside):
        before += n
        if before >= want:
            return np.nextafter(h, 2.0)
    return (b + 1) / bins


def _hashes(data: PreparedData):
    first = 0
    for s in data.shards:
        yield s, unit_hash(np.arange(first, first + s.n_documents, dtype=np.uint64), _SPLIT_SALT)
        first += s.n_documents


def _val_documents(data: PreparedData, val_fraction: float) -> list[np.ndarray]:
    """Per shard, which documents go to val: those whose hash is below :func:`_val_threshold`. Both splits get a
    document when the data has two (a tiny corpus still has something to validate on)."""
    t = _val_threshold(data, val_fraction)
    flags = [h < t for _, h in _hashes(data)]
    total = sum(len(f) for f in flags)
    n_val = sum(int(f.sum()) for f in flags)
    if total >= 2 and n_val in (0, total):  # move the document nearest the threshold
        pick = np.argmin if n_val == 0 else np.argmax
        best = [(float(h[pick(h)]), k, int(pick(h))) for k, (_, h) in enumerate(_hashes(data)) if len(h)]
        _, k, d = (min if n_val == 0 else max)(best)
        flags[k][d] = n_val == 0
    return flags


def _split_runs(data: PreparedData, val_fraction: float) -> dict[str, np.ndarray]:
    """Runs of each split, shard by shard (a run never crosses a shard)."""
    parts: dict[str, list[np.ndarray]] = {
        f"{sp}_{k}": [] for sp in ("train", "val") for k in ("shard", "start", "length")
    }
    for k, (s, val) in enumerate(zip(data.shards, _val_documents(data, val_fraction))):
        n = s.n_documents
        if n == 0:
            continue
        starts = s.document_starts()
        ends = np.append(starts[1:], s.n_tokens)
        change = np.flatnonzero(np.diff(val.astype(np.int8))) + 1
        run_lo, run_hi = np.concatenate([[0], change]), np.append(change, n)
        for split, flag in (("train", False), ("val", True)):
            sel = val[run_lo] == flag
            lo, hi = run_lo[sel], run_hi[sel]
            parts[f"{split}_shard"].append(np.full(len(lo), k, dtype=np.int32))
            parts[f"{split}_start"].append(starts[lo].astype(np.int64))
            parts[f"{split}_length"].append((ends[hi - 1] - starts[lo]).astype(np.int64))
    out = {
        name: np.concatenate(arrays) if arrays else np.zeros(0, np.int32 if name.endswith("shard") else np.int64)
        for name, arrays in parts.items()
    }
    for split in ("train", "val"):  # cumulative: where each run starts in the split's stream
        out[f"{split}_offset"] = np.concatenate([[0], np.cumsum(out.pop(f"{split}_length"))]).astype(np.int64)
    return out


class TokenWindows(Dataset):
    """Packed windows of ``seq_length + 1`` tokens over one split's stream (see the module docstring).

    Pickles as its dataset's path and arrays' sizes, never the mapped memory: a DataLoader worker maps the
    files itself."""

    def __init__(self, stream: SplitStream, seq_length: int, split: str, source: str):
        if seq_length < 1:
            raise ValueError(f"seq_length must be >= 1, got {seq_length}")
        self.stream, self.seq_length, self.split = stream, seq_length, split
        if stream.n_tokens < seq_length + 1:
            raise DataError(
                f"{source}: the {split} split has {stream.n_tokens} tokens, fewer than the seq_length+1 = "
                f"{seq_length + 1} needed for one sample; give more data (data.max_bytes, or data.val_fraction for "
                "val) or lower data.seq_length"
            )

    @property
    def n_tokens(self) -> int:
        return self.stream.n_tokens

    def __len__(self) -> int:
        return (self.stream.n_tokens - 1) // self.seq_length

    def __getitem__(self, i: int) -> torch.Tensor:
        n = len(self)
        i = int(i)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"{self.split} sample {i} out of range for {n} samples")
        return torch.from_numpy(self.stream.read(i * self.seq_length, self.seq_length + 1))

    def __repr__(self) -> str:
        return (
            f"TokenWindows({self.split}: {len(self):,} samples of {self.seq_length + 1} tokens from "
            f"{self.n_tokens:,} tokens of {self.stream.data.path.name})"
        )
