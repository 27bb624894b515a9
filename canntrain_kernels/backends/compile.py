"""The compile backend: ``torch.compile`` of the reference ops (C++/OpenMP code on CPU, Triton on GPU).

Compilation happens on the first call for each new shape/dtype; its artifacts are cached on disk in
``$CANNTRAIN_CACHE/inductor`` (default ``~/.cache/canntrain/inductor``) unless TORCHINDUCTOR_CACHE_DIR
is set, so later processes skip most of the cost.
"""

from __future__ import annotations

import functools
import importlib
import os
from pathlib import Path

import torch

from canntrain_kernels import reference
from canntrain_kernels.cross_entropy import chunk_loss_and_grads, chunked_cross_entropy
from canntrain_kernels.registry import OPS, Kernel, register


def cache_dir() -> Path:
    """Where compiled kernels are cached: $TORCHINDUCTOR_CACHE_DIR, else $CANNTRAIN_CACHE/inductor."""
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        return Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])
    root = os.environ.get("CANNTRAIN_CACHE") or "~/.cache/canntrain"
    return Path(root).expanduser() / "inductor"


def _use_project_cache() -> None:
    path = cache_dir()
    path.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)


def _probe() -> str | None:
    if not hasattr(torch, "compile"):
        return "this torch has no torch.compile"
    try:
        importlib.import_module("torch._inductor")
    except Exception as e:  # pragma: no cover - broken installs only
        return f"torch inductor does not import: {e}"
    return None


def _compiled(fn):
    """torch.compile(fn), compiled lazily on first call so importing this module costs nothing."""
    holder: dict = {}

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if "fn" not in holder:
            _use_project_cache()
            holder["fn"] = torch.compile(fn)
        return holder["fn"](*args, **kwargs)

    wrapper.__wrapped_compiled__ = holder  # for inspection in tests
    return wrapper


_chunk_fn = _compiled(chunk_loss_and_grads)


def cross_entropy(hidden, weight, targets, ignore_index: int = -100, chunk_size: int | None = None):
    """Chunked cross-entropy whose per-chunk work (matmul, logsumexp, softmax gradient) is compiled."""
    return chunked_cross_entropy(hidden, weight, targets, ignore_index, chunk_size, chunk_fn=_chunk_fn)


_UNCOMPILED = ("cross_entropy", "expert_mlp", "attention_block")  # the loss: its own chunk_fn; the others: none
_FNS = {op: _compiled(getattr(reference, op)) for op in OPS if op not in _UNCOMPILED}
_FNS["cross_entropy"] = cross_entropy

for _op in _FNS:
    register(Kernel(_op, "compile", _FNS[_op], devices=("cpu", "cuda", "npu"), probe=_probe, note="torch.compile"))
