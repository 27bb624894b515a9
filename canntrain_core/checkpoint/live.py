"""A live model's weights as a Hugging Face directory, written during training: what a rollout engine (vLLM)
loads at its start and reloads after each update.

Every rank of the trained model calls :func:`write_live_weights`: a sharded parameter (FSDP2, TP: a DTensor) is
gathered whole one output shard at a time (``DTensor.full_tensor``, a collective every rank makes in the same
order), so rank 0 holds at most one shard of the file (``max_shard_size``) beyond its own share, 5 GB by default
whatever the model's size; rank 0 writes. The files are what ``canntrain export`` writes for the same weights
(family names and layouts, ``models.hf_names``), so vLLM and transformers read them as a Hugging Face model.
:func:`live_tensors` gives the same tensors one at a time for a broadcast (``engines/weight_sync.py``) instead.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from canntrain_core.checkpoint.export import parse_size, write_shards
from canntrain_core.checkpoint.names import hf_name
from canntrain_core.families import family_of
from canntrain_core.models.hf_names import to_hf_layout


def _whole(p: torch.Tensor) -> torch.Tensor:
    t = p.detach()
    return t.full_tensor() if isinstance(t, DTensor) else t


def hf_view(model: torch.nn.Module, config) -> tuple[dict, object]:
    """``model``'s parameters as the Hugging Face model has them: (shapes by Hugging Face name, ``load(names)``
    giving those tensors whole; a collective on a sharded model, so every rank loads the same names in order)."""
    params = {hf_name(n): p for n, p in model.named_parameters()}
    if config.tie_word_embeddings:
        params.pop("lm_head.weight", None)  # transformers and vLLM tie it back
    shapes = {n: p.shape for n, p in params.items()}
    return to_hf_layout(config, shapes, lambda names: {n: _whole(params[n]) for n in names})


def live_tensors(
    model: torch.nn.Module, config, dtype: torch.dtype, device: torch.device
) -> tuple[list, Iterator[torch.Tensor]]:
    """What a broadcast to a rollout engine sends: the (Hugging Face name, shape) list, and the tensors in that
    order, one whole tensor at a time in ``dtype`` on ``device`` (every rank iterates them; see :func:`hf_view`)."""
    shapes, load = hf_view(model, config)
    names = list(shapes)
    tensors = (load([n])[n].to(device=device, dtype=dtype).contiguous() for n in names)
    return [(n, list(shapes[n])) for n in names], tensors


def write_live_weights(
    model: torch.nn.Module,
    config,
    out: str | Path,
    dtype: torch.dtype,
    write: bool,
    with_config: bool = True,
    max_shard_size: str = "5GB",
) -> int:
    """``model``'s parameters (a causal LM with Hugging Face names, as trained) into ``out`` as safetensors shards,
    with config.json when ``with_config``; ``write``: whether this rank writes (rank 0). Returns the bytes written."""
    shapes, load = hf_view(model, config)
    out = Path(out)
    if write:
        out.mkdir(parents=True, exist_ok=True)
    _, _, nbytes = write_shards(out, shapes, load, dtype, parse_size(max_shard_size), write=write)
    if write and with_config:
        files = copy.deepcopy(config)
        files.architectures = [family_of(config).causal_lm_class]
        files.dtype = dtype
        files.save_pretrained(out)
    return nbytes
