"""Token shards in Megatron-LM's indexed format: ``PREFIX.bin`` (token ids back to back) + ``PREFIX.idx``.

The format Megatron-LM, Megatron-Core and MindSpeed-LLM train from (``megatron/core/datasets/indexed_dataset.py``):

    .idx  = b"MMIDIDX\\x00\\x00" | version <Q>=1 | dtype code <B> | sequence count <Q> | document count <Q>
            | sequence lengths int32[sequences] | sequence byte pointers int64[sequences]
            | document indices int64[documents + 1]   (sequence index where each document starts; 0 first)
    .bin  = the sequences' token ids, contiguous, in the index's dtype

canntrain writes one sequence per document (its tokens and an EOS, as Megatron's ``preprocess_data.py
--append-eod`` does), so document d is sequence d. Files written by Megatron with several sequences per
document (sentence splitting) read the same way: a document spans sequences ``[doc[d], doc[d+1])``.

:class:`ShardWriter` streams: memory holds one int32 per document written so far, never the tokens.
:class:`IndexedTokens` maps both files and reads nothing until asked.
"""

from __future__ import annotations

import hashlib
import os
import struct
from pathlib import Path

import numpy as np

from canntrain_core.data.cache import DataError

INDEX_HEADER = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
# Megatron's DType enum: the code stored in the index for each token dtype.
DTYPE_CODES = {
    np.dtype(np.uint8): 1,
    np.dtype(np.int8): 2,
    np.dtype(np.int16): 3,
    np.dtype(np.int32): 4,
    np.dtype(np.int64): 5,
    np.dtype(np.float64): 6,
    np.dtype(np.float32): 7,
    np.dtype(np.uint16): 8,
}
_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}
_HEADER_BYTES = len(INDEX_HEADER) + 8 + 1 + 8 + 8  # 34


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 while every id fits (vocab_size <= 65536), else int32 (Megatron's choice for larger vocabularies)."""
    return np.dtype(np.uint16) if vocab_size <= 65536 else np.dtype(np.int32)


def bin_path(prefix: str | Path) -> Path:
    return Path(f"{prefix}.bin")


def idx_path(prefix: str | Path) -> Path:
    return Path(f"{prefix}.idx")


class ShardWriter:
    """Writes one ``PREFIX.bin`` / ``PREFIX.idx`` pair, a document at a time; ``sha256`` is the hash of the
    token bytes written (the shard's identity in a manifest). ``close`` writes the index and fsyncs both."""

    def __init__(self, prefix: str | Path, dtype: np.dtype):
        self.prefix = Path(prefix)
        self.dtype = np.dtype(dtype)
        if self.dtype not in DTYPE_CODES:
            raise ValueError(f"Megatron's index has no code for dtype {self.dtype}")
        self._bin = open(bin_path(prefix), "wb")
        self._lengths = np.empty(1024, dtype=np.int32)
        self.documents = 0
        self.tokens = 0
        self._hash = hashlib.sha256()

    def add(self, ids: np.ndarray) -> None:
        """Append one document's token ids (already in the shard's dtype)."""
        data = ids.tobytes()
        self._bin.write(data)
        self._hash.update(data)
        if self.documents == len(self._lengths):
            self._lengths = np.resize(self._lengths, 2 * len(self._lengths))
        self._lengths[self.documents] = ids.size
        self.documents += 1
        self.tokens += ids.size

    @property
    def sha256(self) -> str:
        return self._hash.hexdigest()

    def close(self) -> None:
        self._bin.flush()
        os.fsync(self._bin.fileno())
        self._bin.close()
        lengths = self._lengths[: self.documents]
        pointers = np.zeros(self.documents, dtype=np.int64)
        np.cumsum(lengths[:-1], dtype=np.int64, out=pointers[1:])
        pointers *= self.dtype.itemsize
        with open(idx_path(self.prefix), "wb") as f:
            f.write(INDEX_HEADER)
            f.write(struct.pack("<Q", INDEX_VERSION))
            f.write(struct.pack("<B", DTYPE_CODES[self.dtype]))
            f.write(struct.pack("<Q", self.documents))
            f.write(struct.pack("<Q", self.documents + 1))
            f.write(lengths.tobytes())
            f.write(pointers.tobytes())
            f.write(np.arange(self.documents + 1, dtype=np.int64).tobytes())
            f.flush()
            os.fsync(f.fileno())

    def abort(self) -> None:
        self._bin.close()


class IndexedTokens:
    """One ``.bin``/``.idx`` pair, memory-mapped: the token stream and where its documents start.

    Opening reads the 34-byte header and checks the file sizes against it (a truncated ``.bin`` or ``.idx``
    is named here, not at step 10,000); the arrays are views of the mapped index, so opening costs the same
    for a 1 MB shard and a 100 GB one."""

    def __init__(self, prefix: str | Path):
        self.prefix = Path(prefix)
        idx, data = idx_path(prefix), bin_path(prefix)
        for p in (idx, data):
            if not p.is_file():
                raise DataError(f"{p}: missing (a Megatron indexed dataset is PREFIX.bin + PREFIX.idx)")
        size = idx.stat().st_size
        with open(idx, "rb") as f:
            head = f.read(_HEADER_BYTES)
        if len(head) < _HEADER_BYTES or head[: len(INDEX_HEADER)] != INDEX_HEADER:
            raise DataError(f"{idx}: not a Megatron index file (no MMIDIDX header)")
        version, code, sequences, documents = struct.unpack("<QBQQ", head[len(INDEX_HEADER) :])
        if version != INDEX_VERSION or code not in _DTYPES:
            raise DataError(f"{idx}: index version {version}, dtype code {code}: not one this reader knows")
        self.dtype = _DTYPES[code]
        need = _HEADER_BYTES + sequences * (4 + 8) + documents * 8
        if size < need:
            raise DataError(f"{idx}: truncated ({size} bytes; its header promises {need})")
        index = np.memmap(idx, dtype=np.uint8, mode="r")
        off = _HEADER_BYTES
        self.sequence_lengths = np.frombuffer(index, dtype=np.int32, count=sequences, offset=off)
        off += 4 * sequences
        self.sequence_pointers = np.frombuffer(index, dtype=np.int64, count=sequences, offset=off)
        off += 8 * sequences
        self.document_indices = np.frombuffer(index, dtype=np.int64, count=documents, offset=off)
        self.n_sequences = sequences
        self.n_documents = max(documents - 1, 0)
        end = int(self.sequence_pointers[-1]) + int(self.sequence_lengths[-1]) * self.dtype.itemsize if sequences else 0
        if data.stat().st_size != end:
            raise DataError(
                f"{data}: {data.stat().st_size} bytes, but {idx.name} indexes {end}: truncated or not its pair"
            )
        self.n_tokens = end // self.dtype.itemsize
        self._tokens: np.memmap | None = None

    @property
    def tokens(self) -> np.ndarray:
        """The whole token stream, mapped read-only (opened in whichever process reads it first)."""
        if self._tokens is None:
            if self.n_tokens == 0:
                self._tokens = np.zeros(0, dtype=self.dtype)
            else:
                self._tokens = np.memmap(bin_path(self.prefix), dtype=self.dtype, mode="r", shape=(self.n_tokens,))
        return self._tokens

    def document_starts(self) -> np.ndarray:
        """Token offset where each document starts (int64, one per document): reads the index's arrays."""
        first_sequence = self.document_indices[:-1]
        return self.sequence_pointers[first_sequence] // self.dtype.itemsize

    def document(self, d: int) -> np.ndarray:
        """The token ids of document ``d``."""
        lo, hi = self.document_indices[d], self.document_indices[d + 1]
        start = int(self.sequence_pointers[lo]) // self.dtype.itemsize
        n = int(self.sequence_lengths[lo:hi].sum())
        return np.asarray(self.tokens[start : start + n])

    def __getstate__(self) -> dict:
        # A DataLoader worker gets the prefix and maps the files itself.
        return {"prefix": self.prefix}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["prefix"])

    def __repr__(self) -> str:
        return f"IndexedTokens({self.prefix}: {self.n_documents:,} documents, {self.n_tokens:,} tokens, {self.dtype})"
