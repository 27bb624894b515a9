"""A live model's weights as a Hugging Face directory, written during training: what a rollout engine (vLLM)
loads at its start and reloads after each update.

Every rank of the trained model calls :func:`write_live_weights`: a sharded parameter (FSDP2, TP: a DTensor) is
gathered whole one output shard at a time (``DTensor.full_tensor``, a collective every rank makes in the same
order), so rank 0 holds at most one shard of the file (``max_shard_size``) beyond its own share, 5 GB by default
whatever the model's size; rank 0 writes. The files are what ``canntrain export`` writes for the same weights
(family names and layouts, ``models.hf_names``), so vLLM and transformers read them as a Hugging Face model.
"""

from __future__ import annotations

import copy
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
    params = {hf_name(n): p for n, p in model.named_parameters()}
    if config.tie_word_embeddings:
        params.pop("lm_head.weight", None)  # transformers and vLLM tie it back
    shapes = {n: p.shape for n, p in params.items()}
    shapes, load = to_hf_layout(config, shapes, lambda names: {n: _whole(params[n]) for n in names})
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
