"""Packed fixed-length samples over a flat token file.

Sample i is the window ``tokens[i*L : i*L + L + 1]`` (L = seq_length): L+1 tokens so the trainer
takes ``x[:, :-1]`` as inputs and ``x[:, 1:]`` as targets, and consecutive samples share one
boundary token so no next-token target is wasted. Documents are packed back to back with EOS
between them, as in GPT-style pretraining.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from canntrain_core.data.cache import DataError


class PackedDataset(Dataset):
    """Map-style dataset of packed windows; the memmap opens lazily in whichever process reads it.

    Lazy opening keeps the pickled dataset a few bytes (path, dtype, length) when a DataLoader
    sends it to worker processes, and each worker maps the file itself.
    """

    def __init__(self, bin_path: str | Path, dtype: str | np.dtype, seq_length: int, split: str = "train"):
        if seq_length < 1:
            raise ValueError(f"seq_length must be >= 1, got {seq_length}")
        self.bin_path = Path(bin_path)
        self.dtype = np.dtype(dtype)
        self.seq_length = seq_length
        self.split = split
        if not self.bin_path.is_file():
            raise FileNotFoundError(f"{split} token file {self.bin_path} does not exist")
        self.n_tokens = self.bin_path.stat().st_size // self.dtype.itemsize
        if self.n_tokens < seq_length + 1:
            raise DataError(
                f"the {split} split has {self.n_tokens} tokens, fewer than the seq_length+1 = "
                f"{seq_length + 1} needed for one sample; raise data.max_bytes (or data.val_fraction "
                "for val) or lower data.seq_length"
            )
        self._tokens: np.memmap | None = None

    @property
    def tokens(self) -> np.memmap:
        """The whole token stream (read-only memmap), opened on first use in this process."""
        if self._tokens is None:
            self._tokens = np.memmap(self.bin_path, dtype=self.dtype, mode="r", shape=(self.n_tokens,))
        return self._tokens

    def __len__(self) -> int:
        return (self.n_tokens - 1) // self.seq_length

    def __getitem__(self, i: int) -> torch.Tensor:
        n = len(self)
        i = int(i)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"{self.split} sample {i} out of range for {n} samples")
        start = i * self.seq_length
        window = self.tokens[start : start + self.seq_length + 1]
        # astype copies out of the memmap, so the tensor owns its memory (safe across workers).
        return torch.from_numpy(window.astype(np.int64))

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_tokens"] = None  # never pickle the mapping: the worker reopens the file
        return state

    def __repr__(self) -> str:
        return (
            f"PackedDataset({self.split}: {len(self):,} samples of {self.seq_length + 1} tokens "
            f"from {self.n_tokens:,} tokens in {self.bin_path.name}, {self.dtype.name})"
        )
