"""Hugging Face's format on the way in: a directory that transformers' ``save_pretrained`` wrote.

``model.init_from: DIR`` reads ``DIR/config.json`` (the architecture), ``model.safetensors`` or the
shards listed in ``model.safetensors.index.json`` (the weights), and ``tokenizer.json`` when present.
Each rank reads only the slices it holds, straight into its (DTensor) shards, with torch's
``HuggingFaceStorageReader`` under DCP. Nothing is ever fetched from the hub (``HF_HUB_OFFLINE``, set by the package).

Names: canntrain's module tree keeps transformers' own Llama names (``model.layers.3.mlp.up_proj.weight``,
``lm_head.weight``), so the one table between the two, ``checkpoint.names.WRAPPERS``, only lists the wrapper modules
that parallel training inserts and the Hugging Face names leave out. A family whose files hold other tensors
(GPT-2's transposed, fused ``c_attn``; Mixtral's experts one file tensor each) says how they map
(``Family.hf_names``, ``models/hf_names.py``): each rank reads only the parts of the files' tensors its shards
cover, and export assembles the files' tensors from canntrain's.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from safetensors import SafetensorError, safe_open
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from canntrain_core.checkpoint.dcp import single_process_ok
from canntrain_core.checkpoint.names import hf_name
from canntrain_core.errors import BadInput
from canntrain_core.families import family_of
from canntrain_core.models.classes import causal_lm_class, config_from_dict, training_class
from canntrain_core.models.hf_names import Piece, pieces, their_shapes


INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class HFFormatError(BadInput):
    """A Hugging Face directory that canntrain cannot read; the message names the file (and tensor)."""


def read_config(directory: str | Path):
    """``DIR/config.json`` as its family's transformers config (``model_type``); an HFFormatError naming the
    file for anything else."""
    path = Path(directory) / "config.json"
    if not Path(directory).exists():
        raise HFFormatError(
            f"model.init_from: {directory} does not exist (relative paths start at {Path.cwd()}). Write it with "
            f"`canntrain export RUN_DIR -o {directory}` from a finished run; the tiny recipes' starts "
            "(runs/tiny_pretrained_hf, runs/tiny_sft_hf and the task data) come from `canntrain start`"
        )
    if not path.is_file():
        raise HFFormatError(f"model.init_from: {path} not found (a Hugging Face model directory holds config.json)")
    try:
        fields = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise HFFormatError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(fields, dict):
        raise HFFormatError(f"{path}: expected a JSON object, got {type(fields).__name__}")
    try:
        return config_from_dict(fields, str(path))
    except BadInput as e:
        raise HFFormatError(str(e)) from None


def check_against_recipe(config, preset_fields: dict[str, Any] | None, overrides: dict[str, Any], source: Path) -> None:
    """With init_from the file defines the model: a preset set explicitly, or an override, that says
    otherwise is an error naming the field."""
    problems = []
    for key, want in (preset_fields or {}).items():
        if key != "vocab_size" and getattr(config, key, None) != want:
            problems.append(
                f"model.preset sets {key}={want}, {source / 'config.json'} has {getattr(config, key, None)}"
            )
    for key, want in overrides.items():
        if getattr(config, key, None) != want:
            problems.append(
                f"model.overrides.{key}={want!r}, {source / 'config.json'} has {getattr(config, key, None)!r}"
            )
    if problems:
        raise BadInput(
            "model.init_from: the recipe contradicts the checkpoint's config (with init_from the "
            "architecture comes from config.json; drop model.preset / model.overrides):\n  " + "\n  ".join(problems)
        )


# Which config key a tensor's dimension shows: (tensor name suffix, dimension) -> key.
_SHAPE_KEYS = {
    ("embed_tokens.weight", 0): "vocab_size",
    ("embed_tokens.weight", 1): "hidden_size",
    ("mlp.up_proj.weight", 0): "intermediate_size",
    ("self_attn.q_proj.weight", 0): "num_attention_heads",
    ("self_attn.k_proj.weight", 0): "num_key_value_heads",
}


def check_weights(config, directory: str | Path) -> None:
    """The safetensors in DIR are the tensors config.json describes, all of them, of the shapes it implies.

    A disagreement is named by its config key, once (``hidden_size`` wrong shows in 22 tensors of a
    2-layer model: one line says so); tensors the config does not use are named, not ignored. Reads
    the headers only; the model is built on ``meta``.
    """
    d = Path(directory)
    available = _with_prefix(weight_files(d), config)
    with torch.device("meta"):
        ours = {n: t.shape for n, t in training_class(config)(config).state_dict().items()}
    if config.tie_word_embeddings:
        ours.pop("lm_head.weight", None)
    expected = {n: list(s) for n, s in their_shapes(config, ours).items()}  # the files' names and shapes
    keys: dict[str, str] = {}
    problems = []
    for (suffix, dim), key in _SHAPE_KEYS.items():  # a key is wrong when every tensor it shapes disagrees
        shaped = [(n, available[n]["shape"]) for n in expected if n.endswith(suffix) and n in available]
        wrong = [(n, s) for n, s in shaped if len(s) > dim and s[dim] != expected[n][dim]]
        if shaped and len(wrong) == len(shaped) and key not in keys:
            name, shape = wrong[0]
            keys[key] = f"config.json's {key}={getattr(config, key)} disagrees with the tensors ({name} is {shape})"
    for name, shape in expected.items():
        have = available.get(name)
        if have is None or have["shape"] == shape:
            continue
        problems.append(f"{name} in {have['file']}: shape {have['shape']}, the model needs {shape}")
    layers = {int(m[1]) for m in (re.match(r"\w+\.(?:layers|h)\.(\d+)\.", n) for n in available) if m}
    if layers and max(layers) + 1 != config.num_hidden_layers:
        keys["num_hidden_layers"] = (
            f"config.json's num_hidden_layers={config.num_hidden_layers} disagrees with the "
            f"tensors (they hold {max(layers) + 1} layers)"
        )
    if "lm_head.weight" in available and config.tie_word_embeddings:
        keys["tie_word_embeddings"] = (
            "config.json's tie_word_embeddings=true, but the files hold an lm_head.weight "
            "of their own (set it to false to use it)"
        )
    if (
        "lm_head.weight" not in available
        and not config.tie_word_embeddings
        and "model.embed_tokens.weight" in available
    ):
        keys["tie_word_embeddings"] = (
            "config.json's tie_word_embeddings=false, but the files hold no lm_head.weight "
            "(a tied model: set it to true)"
        )
    if not keys:  # what is left is not explained by one key: name the tensors
        missing = [n for n in expected if n not in available]
        ignorable = getattr(causal_lm_class(config), "_keys_to_ignore_on_load_unexpected", None) or []
        ignored = [re.compile(p) for p in ignorable]  # buffers older files hold (GPT-2's attn.bias)
        unused = [n for n in available if n not in expected and not any(i.search(n) for i in ignored)]
        problems += [f"{n}: missing from {d} (no safetensors file holds it)" for n in missing]
        problems += [f"{n} in {available[n]['file']}: not a tensor of the model config.json describes" for n in unused]
    lines = list(keys.values()) or problems  # a wrong key shows in many tensors: say the key
    if lines:
        more = f"\n  ... and {len(lines) - 8} more" if len(lines) > 8 else ""
        raise HFFormatError(f"model.init_from: {d} does not fit its config.json:\n  " + "\n  ".join(lines[:8]) + more)


def weight_files(directory: str | Path) -> dict[str, dict[str, Any]]:
    """Every tensor in DIR's safetensors files: name -> {file, shape, dtype}, read from the headers only.

    Uses the index when there is one (its files must all exist); a header that is not one is an
    error naming the file.
    """
    d = Path(directory)
    if (d / INDEX).is_file():
        try:
            files = sorted(set(json.loads((d / INDEX).read_text())["weight_map"].values()))
        except (ValueError, KeyError, AttributeError) as e:
            raise HFFormatError(f"{d / INDEX}: not a safetensors index ({e!r})") from None
    elif (d / SINGLE).is_file():
        files = [SINGLE]
    else:
        raise HFFormatError(f"model.init_from: {d} holds neither {SINGLE} nor {INDEX}")
    tensors: dict[str, dict[str, Any]] = {}
    for name in files:
        path = d / name
        if not path.is_file():
            raise HFFormatError(f"{d / INDEX}: lists {name}, which is missing from {d}")
        try:
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():
                    s = f.get_slice(key)
                    tensors[key] = {"file": name, "shape": list(s.get_shape()), "dtype": s.get_dtype()}
        except (SafetensorError, OSError) as e:
            raise HFFormatError(f"{path}: not a safetensors file ({e})") from None
    # The reader below lists the directory itself: a stray .safetensors file would be read too.
    stray = sorted(p.name for p in d.glob("*.safetensors") if p.name not in files)
    if stray:
        raise HFFormatError(f"{d}: {', '.join(stray)} not listed in {INDEX}; move it out of the directory")
    return tensors


@torch.no_grad()
def load_weights(model: torch.nn.Module, directory: str | Path, skip=lambda name: False) -> list[dict[str, Any]]:
    """Fill every parameter of ``model`` (already materialized, possibly sharded) from DIR's safetensors,
    but those ``skip(name)`` says are not there (LoRA adapters).

    Each rank reads only its own slice of each tensor. Returns, for this rank, one row per tensor:
    name, file, full shape and the slice it read (the interop notebook tabulates them).
    """
    d = Path(directory)
    available = _with_prefix(weight_files(d), model.config)
    state = {hf_name(n): p for n, p in model.named_parameters() if not skip(n)}
    parts = {key: pieces(model.config, key, p.shape) for key, p in state.items()}
    want = their_shapes(model.config, {key: p.shape for key, p in state.items()})
    problems = []
    for source in sorted({piece.theirs for ps in parts.values() for piece in ps}):
        if source not in available:
            problems.append(f"{source}: missing from {d} (no safetensors file holds it)")
        elif list(want[source]) != available[source]["shape"]:
            problems.append(
                f"{source} in {available[source]['file']}: shape {available[source]['shape']}, "
                f"the model needs {list(want[source])}"
            )
    if problems:
        raise HFFormatError(f"model.init_from: {d} does not fit the model:\n  " + "\n  ".join(problems))
    if family_of(model.config).hf_names:
        for key, p in state.items():
            _read_pieces(p, parts[key], d, available)
    else:
        with single_process_ok():
            dcp.load(state, storage_reader=HuggingFaceStorageReader(str(d)))
    return [
        {"tensor": key, "file": available[parts[key][0].theirs]["file"], "shape": list(p.shape), "slice": _slice(p)}
        for key, p in state.items()
    ]


def directory_tensors(config, directory: str | Path):
    """DIR's model as canntrain's tensors: (canntrain's name -> shape, ``load(names)`` -> whole tensors), each
    assembled from the files' tensors that hold it (GPT-2's fused c_attn, Mixtral's per-expert files)."""
    d = Path(directory)
    with torch.device("meta"):
        shapes = {hf_name(n): p.shape for n, p in training_class(config)(config).named_parameters()}
    available = _with_prefix(weight_files(d), config)

    def load(names: list[str]) -> dict[str, torch.Tensor]:
        out = {}
        for n in names:
            out[n] = torch.empty(shapes[n], dtype=torch.float32)
            _read_pieces(out[n], pieces(config, n, shapes[n]), d, available)
        return out

    return shapes, load


def _with_prefix(available: dict[str, dict[str, Any]], config) -> dict[str, dict[str, Any]]:
    """The files' tensors by the names of transformers' ...ForCausalLM: a base model's files (GPT-2's on the hub:
    ``h.0.attn.c_attn.weight``) gain its ``base_model_prefix`` (``key``: the name in the file)."""
    prefix = causal_lm_class(config).base_model_prefix + "."
    bare = available and not any(n.startswith(prefix) for n in available) and family_of(config).hf_names
    return {(prefix + n if bare and n != "lm_head.weight" else n): {**v, "key": n} for n, v in available.items()}


def _read_pieces(p: torch.Tensor, parts: list[Piece], d: Path, available: dict[str, dict[str, Any]]) -> None:
    """This rank's shard of ``p`` read from the files' tensors that hold it (``parts``): only the blocks it
    covers are read."""
    shape, offset, local = tuple(p.shape), (0,) * p.dim(), p
    if isinstance(p, DTensor):
        shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
        local = p.to_local()
    if local.numel() == 0:
        return
    mine = [(o, o + n) for n, o in zip(shape, offset)]
    for piece in parts:
        cut = tuple((max(a, b), min(c, e)) for (a, c), (b, e) in zip(mine, piece.box))
        if any(start >= stop for start, stop in cut):
            continue
        stored = available[piece.theirs]
        with safe_open(str(d / stored["file"]), framework="pt") as f:
            block = f.get_slice(stored["key"])[piece.their_slices(cut)]
        local[tuple(slice(s - o, t - o) for (s, t), (o, _) in zip(cut, mine))] = piece.as_ours(block)


def _slice(p: torch.Tensor) -> str:
    """The part of the full tensor this rank holds, e.g. ``[32:64, 0:128]``."""
    shape, offset = tuple(p.shape), (0,) * p.dim()
    if isinstance(p, DTensor):
        shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    return "[" + ", ".join(f"{o}:{o + n}" for n, o in zip(shape, offset)) + "]"


def tokenizer_eos(directory: str | Path, config, tokenizer) -> int:
    """The EOS id of DIR's tokenizer: tokenizer_config.json's eos_token, else config.json's eos_token_id."""
    d = Path(directory)
    eos = None
    cfg_path = d / "tokenizer_config.json"
    if cfg_path.is_file():
        eos = json.loads(cfg_path.read_text()).get("eos_token")
        if isinstance(eos, dict):  # {"content": "</s>", ...}
            eos = eos.get("content")
    eos_id = tokenizer.token_to_id(eos) if isinstance(eos, str) else None
    if eos_id is None:
        eos_id = config.eos_token_id[0] if isinstance(config.eos_token_id, list) else config.eos_token_id
    if eos_id is None:
        raise HFFormatError(
            f"{d / 'tokenizer.json'}: no EOS token (neither tokenizer_config.json's eos_token nor "
            "config.json's eos_token_id); documents need one between them"
        )
    return int(eos_id)


_WHOLE_FILE = 64 * 2**20  # hash files up to this size whole; sample bigger ones (a 70B base is 140 GB)
_SAMPLES, _SAMPLE_BYTES = 64, 2**20


def _file_digest(path: Path) -> str:
    """sha256 of the file, or of its size and 64 evenly spaced 1 MiB pieces when it is larger than 64 MiB:
    a replaced or retrained weight file changes it, at the cost of reading 64 MiB, not the file."""
    size = path.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        if size <= _WHOLE_FILE:
            h.update(f.read())
        else:
            for i in range(_SAMPLES):
                f.seek(i * (size - _SAMPLE_BYTES) // (_SAMPLES - 1))
                h.update(f.read(_SAMPLE_BYTES))
    return h.hexdigest()


def base_fingerprint(directory: str | Path) -> dict[str, str]:
    """What identifies a base model directory: config.json's and each safetensors file's digest. A LoRA run
    keeps it beside its adapters; ``--merge`` and a resume compare it with what is at the path now."""
    d = Path(directory)
    names = ["config.json", *sorted({v["file"] for v in weight_files(d).values()})]
    return {name: _file_digest(d / name) for name in names}


def base_changes(saved: dict[str, str], now: dict[str, str]) -> list[str]:
    """The files whose digest differs between two fingerprints (empty: the same base)."""
    return sorted(k for k in {*saved, *now} if saved.get(k) != now.get(k))
