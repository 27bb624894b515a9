"""``canntrain export``: a canntrain checkpoint (DCP, any layout) to a Hugging Face model directory.

Writes what transformers' ``save_pretrained`` writes for the model's family (GPT-2's tensors in its files'
names and layouts, ``models.hf_names.to_hf_layout``): ``config.json``,
``generation_config.json`` (``model.init_from``'s when it had one), ``model.safetensors`` or shards plus
``model.safetensors.index.json``, and the tokenizer as ``tokenizer.json`` + ``tokenizer_config.json`` (its
special tokens) + ``chat_template.jinja`` (the template the run formatted conversations with: the
tokenizer's, or ``data.template`` as Jinja), so that plain ``AutoModelForCausalLM.from_pretrained(DIR)``,
``AutoTokenizer.from_pretrained(DIR)`` and its ``apply_chat_template`` work as the run did.

The export never gathers the model: DCP's metadata says which tensors exist, and one output shard at
a time (``--max-shard-size``) is read from the checkpoint's files, cast and written. A checkpoint
written by 64 ranks exports in one process holding one shard; its tensors are the same bytes as an
export of the same weights written by one rank, since DCP stores whole tensors' pieces, not layouts.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
import yaml
from safetensors.torch import save_file
from tokenizers import Tokenizer
from torch.distributed.checkpoint import FileSystemReader
from transformers import GenerationConfig

from canntrain_core.checkpoint.dcp import CheckpointError, latest_checkpoint, single_process_ok, verify_checkpoint
from canntrain_core.data.cache import DataError
from canntrain_core.data.tokenizer import check_agrees_with_transformers
from canntrain_core.errors import BadInput
from canntrain_core.families import family_of
from canntrain_core.models.classes import config_from_dict
from canntrain_core.models.hf import base_changes, base_fingerprint, directory_tensors
from canntrain_core.models.hf_names import to_hf_layout
from canntrain_core.models.lora import is_adapter, peft_config, peft_key
from canntrain_core.recipe import LoraSettings
from canntrain_core.runtime.accelerator import DTYPES

_UNITS = {
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_size(text: str) -> int:
    """'5GB' -> 5_000_000_000, '500MiB' -> 524_288_000 (Hugging Face's units: GB decimal, GiB binary)."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([A-Za-z]*)\s*", str(text))
    unit = (m.group(2) or "B").upper() if m else ""
    if not m or unit not in _UNITS:
        raise BadInput(f"--max-shard-size {text!r}: expected a size such as 5GB, 500MB or 2GiB")
    return int(float(m.group(1)) * _UNITS[unit])


BASE_FINGERPRINT = "base_fingerprint.json"  # in a LoRA checkpoint: the base model its adapters adapt


def check_base(ckpt: Path, base: str | Path, what: str, now: dict[str, str] | None = None) -> None:
    """A LoRA checkpoint's adapters were trained on the base its fingerprint names; refuse ``what``
    (``--merge``, ``generate``, ``resume``) when the directory at ``base`` now holds something else.
    ``now``: the base's fingerprint when the caller has it already."""
    saved = Path(ckpt) / BASE_FINGERPRINT
    if not saved.is_file():  # written by an older canntrain: nothing to compare
        return
    changed = base_changes(json.loads(saved.read_text()), now or base_fingerprint(base))
    if changed:
        raise BadInput(
            f"{what}: the LoRA base {base} is not the model {ckpt}'s adapters were trained on "
            f"({', '.join(changed)} changed since; {saved.name} holds the original's fingerprint): "
            "put the original back at that path, or train the adapters anew"
        )


STAGE_FILE = "stage.json"  # in every checkpoint: what the stage that wrote it says about its model state


def language_model_prefix(ckpt: Path) -> str:
    """Where the language model sits in the checkpoint's model state ('' or PPO's 'actor.'), as the stage that
    wrote it says (``stage.json``); a checkpoint whose model is no language model (a reward model) is refused
    with the stage's reason. Export and generate read this, never the recipe's train_mode."""
    path = Path(ckpt) / STAGE_FILE
    stage = json.loads(path.read_text()) if path.is_file() else {}
    if stage.get("not_a_language_model"):
        raise BadInput(f"{ckpt}: {stage['not_a_language_model']}")
    return stage.get("language_model", "")


def stored_language_model(ckpt: Path) -> tuple[dict, str]:
    """DCP metadata of the checkpoint's language model by Hugging Face name, and where it sits in the model
    state (:func:`language_model_prefix`)."""
    prefix = "model." + language_model_prefix(ckpt)
    meta = FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    return {k.removeprefix(prefix): v for k, v in meta.items() if k.startswith(prefix)}, prefix.removeprefix("model.")


def language_model_tensors(ckpt: Path, recipe: dict, config, merge: bool, what: str):
    """The checkpoint's language model as (Hugging Face name -> shape, ``load(names)`` -> whole tensors), what
    export writes and generate runs. ``merge``: a LoRA run's base (its fingerprint checked first; ``what`` names
    the caller in that error) with the adapters folded in. A tied config loses lm_head.weight (transformers ties
    it back); a checkpoint whose head differs from its embedding (written before training kept the tie) has
    ``config.tie_word_embeddings`` set to False: what it trained."""
    stored, prefix = stored_language_model(ckpt)
    if merge:
        check_base(ckpt, recipe["model"]["init_from"], what)
        shapes, load = _merged_source(ckpt, stored, recipe, config)
    else:
        shapes = {n: v.size for n, v in stored.items()}
        load = partial(_load_from_checkpoint, ckpt, stored, prefix=prefix)
        if config.tie_word_embeddings and "lm_head.weight" in shapes:
            pair = load(["model.embed_tokens.weight", "lm_head.weight"])
            config.tie_word_embeddings = torch.equal(pair["model.embed_tokens.weight"], pair["lm_head.weight"])
    if config.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    return shapes, load


def resolve_checkpoint(source: str | Path) -> Path:
    """A checkpoint directory, or a run directory's newest complete checkpoint."""
    p = Path(source)
    if (p / "checkpoints").is_dir():
        found = latest_checkpoint(p / "checkpoints")
        if found is None:
            raise CheckpointError(f"{p}: no complete checkpoint under {p / 'checkpoints'}")
        return found
    if (p / "metrics.jsonl").is_file() or ((p / "recipe.resolved.yaml").is_file() and not (p / ".metadata").is_file()):
        raise CheckpointError(
            f"no checkpoint in {p}: the run wrote none (it saves every logging.ckpt_interval "
            "steps and at its last step)"
        )
    verify_checkpoint(p)
    return p


def _layer_order(name: str) -> tuple:
    # embeddings, then layers in numeric order, then the final norm and the head: how HF shards read
    return tuple(int(t) if t.isdigit() else t for t in re.split(r"\.(\d+)\.", name))


@dataclass
class Export:
    out: Path
    checkpoint: Path
    files: list[str]
    tensors: int
    bytes: int


def export_hf(
    source: str | Path, out: str | Path, dtype: str | None = None, max_shard_size: str = "5GB", merge: bool = False
) -> Export:
    """Write the checkpoint ``source`` (or a run directory's newest) as a Hugging Face directory ``out``.

    ``dtype``: bf16, fp16 or fp32; default the recipe's precision (fp32 weights stay fp32).
    A LoRA run's checkpoint (adapters only) is written as a peft adapter directory, or with ``merge``
    as a whole model: its ``model.init_from`` base with W + (alpha / rank) B A folded in.
    ``out`` must not exist yet (or be empty): nothing is ever overwritten; it appears complete or not at all.
    """
    ckpt = resolve_checkpoint(source)
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise BadInput(f"{out}: already exists and is not empty; export into a new directory")
    if not (ckpt / "config.json").is_file():
        raise CheckpointError(f"{ckpt}: no config.json (written by an older canntrain); cannot export it")
    recipe = yaml.safe_load((ckpt / "recipe.resolved.yaml").read_text())
    lora = holds_adapters(ckpt)
    if merge and not lora:
        raise BadInput(f"--merge: {ckpt} is not a LoRA run's checkpoint; there is no adapter to merge")
    dtype = dtype or {"bf16": "bf16", "fp16": "fp16"}.get(recipe["model"]["precision"], "fp32")
    if dtype not in DTYPES:
        raise BadInput(f"--dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    config = config_from_dict(json.loads((ckpt / "config.json").read_text()), str(ckpt / "config.json"))
    config.architectures = [family_of(config).causal_lm_class]
    config.dtype = DTYPES[dtype]

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        if lora and not merge:
            done = _write_adapter(ckpt, stored_language_model(ckpt)[0], recipe, tmp, DTYPES[dtype])
        else:
            shapes, load = to_hf_layout(config, *language_model_tensors(ckpt, recipe, config, merge, "--merge"))
            done = write_shards(tmp, shapes, load, DTYPES[dtype], parse_size(max_shard_size))
            config.save_pretrained(tmp)
            _write_generation_config(ckpt, config, tmp)
        _write_tokenizer(ckpt, config, tmp)
        if out.exists():
            out.rmdir()  # empty (checked above)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Export(out, ckpt, *done)


def _load_from_checkpoint(ckpt: Path, stored: dict, names: list[str], prefix: str = "") -> dict[str, torch.Tensor]:
    """These tensors, whole, read from the DCP checkpoint's files (whatever layout wrote them); ``prefix``:
    where they sit in the checkpoint's model (a PPO run's actor: ``actor.``)."""
    part = {prefix + n: torch.empty(stored[n].size, dtype=stored[n].properties.dtype) for n in names}
    with single_process_ok():
        dcp.load({"model": part}, storage_reader=FileSystemReader(str(ckpt)))
    return {n.removeprefix(prefix): t for n, t in part.items()}


def write_shards(out: Path, shapes: dict[str, torch.Size], load, dtype: torch.dtype, limit: int, write: bool = True):
    """Safetensors shards of at most ``limit`` bytes (and their index), loading one shard at a time.
    Returns (files, tensors, bytes). ``write`` False: load the same shards in the same order and write nothing (the
    ranks of a sharded model that gather with rank 0, which writes)."""
    names = sorted(shapes, key=_layer_order)
    itemsize = torch.empty((), dtype=dtype).element_size()
    shards: list[list[str]] = [[]]
    size = 0
    for n in names:
        nbytes = shapes[n].numel() * itemsize
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(n)
        size += nbytes
    weight_map, total, files = {}, 0, []
    for i, group in enumerate(shards, start=1):
        fname = "model.safetensors" if len(shards) == 1 else f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        part = {n: t.to(dtype).contiguous() for n, t in load(group).items()}
        if write:
            save_file(part, str(out / fname), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in part.values())
        weight_map.update({n: fname for n in group})
        files.append(fname)
        del part
    if len(shards) > 1 and write:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return files, len(names), total


def _adapters(stored: dict) -> list[str]:
    return [n for n in stored if is_adapter(n)]


def holds_adapters(ckpt: Path) -> bool:
    """Whether the checkpoint's language model is LoRA adapters (a base named by its fingerprint), read off
    its tensors."""
    return bool(_adapters(stored_language_model(ckpt)[0]))


def _write_adapter(ckpt: Path, stored: dict, recipe: dict, out: Path, dtype: torch.dtype):
    """peft's format: adapter_config.json (peft's own writer) + adapter_model.safetensors."""
    base = str(Path(recipe["model"]["init_from"]).resolve())
    peft_config(LoraSettings(**recipe["lora"]), base).save_pretrained(out)
    weights = {
        peft_key(n): t.to(dtype).contiguous() for n, t in _load_from_checkpoint(ckpt, stored, _adapters(stored)).items()
    }
    save_file(weights, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    return ["adapter_model.safetensors"], len(weights), sum(t.numel() * t.element_size() for t in weights.values())


def _merged_source(ckpt: Path, stored: dict, recipe: dict, config):
    """The base model's tensors (from its init_from directory, by canntrain's names) with the adapters folded
    in, a few at a time."""
    shapes, base = directory_tensors(config, recipe["model"]["init_from"])
    adapters = _load_from_checkpoint(ckpt, stored, _adapters(stored))  # small: rank x (in + out) per target
    scale = recipe["lora"]["alpha"] / recipe["lora"]["rank"]

    def load(names: list[str]) -> dict[str, torch.Tensor]:
        part = base(names)
        for n, w in part.items():
            a = adapters.get(n.replace(".weight", ".lora_A.default.weight"))
            if a is not None:
                b = adapters[n.replace(".weight", ".lora_B.default.weight")]
                part[n] = w + scale * (b.float() @ a.float())
        return part

    return shapes, load


def _write_tokenizer(ckpt: Path, config, out: Path) -> None:
    """The tokenizer through transformers' own writer, so AutoTokenizer loads it: tokenizer.json, and
    tokenizer_config.json with the special tokens and the chat template the run used (the checkpoint's
    tokenizer_config.json and chat_template.jinja; a checkpoint older than those: the EOS of config.json)."""
    # deferred: start-up time (transformers' tokenizer classes load sentencepiece, ~20 ms; --help imports this)
    from transformers import PreTrainedTokenizerFast

    if not (ckpt / "tokenizer.json").is_file():
        return
    if (ckpt / "tokenizer_config.json").is_file():
        fast = PreTrainedTokenizerFast.from_pretrained(str(ckpt))
        fast.init_kwargs.pop("is_local", None), fast.init_kwargs.pop("local_files_only", None)  # how it was read
    else:
        tok = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
        eos_id = config.eos_token_id[0] if isinstance(config.eos_token_id, list) else config.eos_token_id
        eos = tok.id_to_token(eos_id) if eos_id is not None else None
        fast = PreTrainedTokenizerFast(
            tokenizer_object=tok, eos_token=eos, model_max_length=config.max_position_embeddings
        )
    fast.save_pretrained(out)
    try:  # transformers may rebuild the tokenizer of the export's model type (Qwen2Tokenizer) otherwise
        check_agrees_with_transformers(out, fast.backend_tokenizer)
    except DataError as e:
        raise CheckpointError(
            f"{ckpt}: its tokenizer does not survive export as a {config.model_type} model: {e}. A tokenizer "
            f"trained by canntrain prepare is model-agnostic; train a {config.model_type} model's tokenizer in "
            "the run (data.tokenizer) or save the model's own with transformers"
        ) from None


def _write_generation_config(ckpt: Path, config, out: Path) -> None:
    """generation_config.json: model.init_from's (sampling settings, its list of end tokens), which the
    checkpoint carries; else, as transformers does, one from the model's config."""
    if not (ckpt / "generation_config.json").is_file():
        GenerationConfig.from_model_config(config).save_pretrained(out)
        return
    try:
        GenerationConfig.from_pretrained(str(ckpt)).save_pretrained(out)
    except ValueError:  # a source file transformers would not write itself: carried as it is
        shutil.copyfile(ckpt / "generation_config.json", out / "generation_config.json")
