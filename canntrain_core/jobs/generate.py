"""Sampling from a trained model: a run directory (its newest complete checkpoint), a checkpoint directory,
or a Hugging Face directory (a ``canntrain export``, or any Llama transformers' ``save_pretrained`` wrote).

The model runs as training runs it (``models.lm.CausalLM``) and decodes with the rollouts' KV-cached loop
(``models.rollout.generate``), stopping once every answer has ended (the tokenizer's EOS, or any end token
of the model's generation_config.json). Its tokenizer and chat template come through the same path the
data builders take (``data.tokenizer.pretrained_tokenizer``): ``chat=True`` encodes the prompt exactly as
training encoded a sample's prompt (``finetune.format.ChatFormat.prompt``), generation prompt included.

A LoRA run's checkpoint holds adapters only: its base (the recipe's ``model.init_from``) is read with the
adapters folded in, as ``canntrain export --merge`` writes it. ``load_generator`` + ``Generator.generate``
are what ``canntrain generate`` calls.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from canntrain_core.checkpoint.dcp import checkpoint_config, checkpoint_recipe
from canntrain_core.checkpoint.export import STAGE_FILE, holds_adapters, language_model_tensors, resolve_checkpoint
from canntrain_core.data.tokenizer import pretrained_tokenizer
from canntrain_core.errors import BadInput
from canntrain_core.finetune.format import ChatFormat
from canntrain_core.models.classes import config_from_dict, training_class
from canntrain_core.models.hf import load_weights, read_config, weight_files
from canntrain_core.models.init import reset_buffers
from canntrain_core.models.lifecycle import tie_head
from canntrain_core.models.lm import CausalLM
from canntrain_core.models.rollout import generate
from canntrain_core.recipe import TemplateConfig
from canntrain_core.runtime import get_accelerator
from canntrain_core.runtime.accelerator import DTYPES


@dataclass
class Completion:
    prompt: str
    prompt_ids: list[int]
    ids: list[int]  # generated tokens, the end token included when one was generated
    text: str  # the generated text, without its end token
    ended: bool  # an end token was generated (else max_new_tokens ran out)


@dataclass
class Generator:
    """A model ready to sample from, with its tokenizer, end tokens and (when it has one) chat format."""

    model: Any  # a CausalLM in eval mode
    tokenizer: Any  # tokenizers.Tokenizer
    eos_id: int
    end_ids: tuple[int, ...]  # every token that ends an answer
    format: Any  # finetune.format.ChatFormat, or None: no chat template
    source: str  # what was loaded (a checkpoint or a Hugging Face directory)
    chat_source: str | None  # where the chat template comes from

    def prompt_ids(self, prompt: str, chat: bool = False, system: str | None = None) -> list[int]:
        """The ids generation starts from: ``prompt`` as a user turn in the model's chat template (after
        ``system``), or as raw text."""
        if chat:
            if self.format is None:
                raise BadInput(
                    f"--chat: {self.source} has no chat template (chat_template.jinja or "
                    "tokenizer_config.json's chat_template); leave out --chat to continue raw text"
                )
            turns = ((("system", system),) if system else ()) + (("user", prompt),)
            return self.format.prompt(turns)
        if system:
            raise BadInput("--system: a system prompt goes into the chat template; add --chat")
        ids = self.tokenizer.encode(prompt, add_special_tokens=True).ids
        if not ids:
            raise BadInput("--prompt: empty; give some text to continue (or --chat)")
        return ids

    @torch.no_grad()
    def generate(
        self,
        prompts: str | list[str],
        chat: bool = False,
        system: str | None = None,
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        top_k: int = 0,
        seed: int = 0,
    ) -> list[Completion]:
        """One completion per prompt (all decoded in one left-padded batch); ``temperature`` 0: greedy."""
        if isinstance(prompts, str):
            prompts = [prompts]
        if max_new_tokens < 1:
            raise BadInput(f"--max-new-tokens {max_new_tokens}: must be at least 1")
        if temperature < 0:
            raise BadInput(f"--temperature {temperature}: must be >= 0 (0: greedy)")
        ids = [self.prompt_ids(p, chat, system) for p in prompts]
        positions = self.model.config.max_position_embeddings
        longest = max(len(i) for i in ids)
        if longest + max_new_tokens > positions:
            raise BadInput(
                f"a {longest}-token prompt + --max-new-tokens {max_new_tokens} is longer than the model's {positions} "
                "positions: shorten the prompt or ask for fewer tokens"
            )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            rows = generate(self.model, ids, max_new_tokens, self.eos_id, temperature, top_k, stop_ids=self.end_ids)
        out = []
        for prompt, p, row in zip(prompts, ids, rows):
            end = next((i for i, t in enumerate(row) if t in self.end_ids), None)
            row = row if end is None else row[: end + 1]
            text = self.tokenizer.decode(row if end is None else row[:-1], skip_special_tokens=False)
            out.append(Completion(prompt, p, row, text, end is not None))
        return out


def load_generator(source: str | Path, device: str | torch.device | None = None, dtype: str = "fp32") -> Generator:
    """The model of ``source`` (run directory, checkpoint, or Hugging Face directory) on ``device`` (default:
    the accelerator canntrain trains on), in ``dtype``, with its tokenizer and chat template."""
    p = Path(source)
    if not p.is_dir():
        raise BadInput(
            f"{p}: {'not a directory' if p.exists() else 'no such directory'} (expected a run directory, "
            "a checkpoint directory or a Hugging Face model directory)"
        )
    if dtype not in DTYPES:
        raise BadInput(f"--dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    device = torch.device(device) if device is not None else get_accelerator().device
    is_run = any(
        (p / n).exists() for n in ("checkpoints", "metrics.jsonl", "recipe.resolved.yaml", "manifest.json", ".metadata")
    )
    if is_run:
        return _from_checkpoint(p, device, DTYPES[dtype])
    if (p / "adapter_config.json").is_file() and not (p / "config.json").is_file():
        raise BadInput(
            f"{p}: a peft adapter without its base; give the LoRA run's directory (its base is read "
            "from the recipe's model.init_from) or export it with `canntrain export --merge`"
        )
    if (p / "config.json").is_file():
        return _from_hf(p, device, DTYPES[dtype])
    raise BadInput(
        f"{p}: neither a run directory (checkpoints/), a checkpoint (manifest.json) nor a Hugging Face "
        "model directory (config.json)"
    )


def _from_hf(d: Path, device: torch.device, dtype: torch.dtype) -> Generator:
    """A Hugging Face directory (canntrain's export or transformers' save_pretrained) read as training reads
    ``model.init_from``: the family's file names and layouts (GPT-2's fused c_attn, the experts' own tensors)
    mapped onto canntrain's (``models.hf.load_weights``)."""
    config = read_config(d)
    files = weight_files(d)  # a missing or damaged shard is named
    head, embed = files.get("lm_head.weight"), files.get("model.embed_tokens.weight")
    if config.tie_word_embeddings and head is not None and embed is not None:
        with safe_open(str(d / head["file"]), "pt") as h, safe_open(str(d / embed["file"]), "pt") as e:
            if not torch.equal(h.get_tensor("lm_head.weight"), e.get_tensor("model.embed_tokens.weight")):
                config.tie_word_embeddings = False  # a head that differs from the embedding is what was trained
    model = _build(config, None, device, dtype, d)
    return _finish(model, config, d, None)


def _from_checkpoint(path: Path, device: torch.device, dtype: torch.dtype) -> Generator:
    ckpt = resolve_checkpoint(path)
    recipe = checkpoint_recipe(ckpt)
    fields = checkpoint_config(ckpt)
    if fields is None:
        raise BadInput(f"{ckpt}: no config.json (written by an older canntrain); cannot build its model")
    config = config_from_dict(fields, str(ckpt / "config.json"))
    # PPO: the actor generates, the critic stays behind; LoRA: adapters only, the base with them folded in
    shapes, load = language_model_tensors(ckpt, recipe, config, merge=holds_adapters(ckpt), what="generate")
    model = _build(config, load(sorted(shapes)), device, dtype, ckpt)
    # a checkpoint older than stage.json and chat_template.jinja: the template its recipe would format with
    template = None if (ckpt / STAGE_FILE).is_file() else recipe.get("data", {}).get("template")
    fallback = TemplateConfig(**template) if template else None
    return _finish(model, config, ckpt, fallback)


def _build(config, tensors: dict[str, torch.Tensor] | None, device: torch.device, dtype: torch.dtype, where: Path):
    """The CausalLM of ``config`` on ``device`` in ``dtype``, its parameters ``tensors`` (canntrain's names;
    a tied model may leave out lm_head.weight), or with ``tensors`` None read from the Hugging Face directory
    ``where``."""
    if tensors is not None:
        head, embed = tensors.get("lm_head.weight"), tensors.get("model.embed_tokens.weight")
        if config.tie_word_embeddings and head is not None and embed is not None and not torch.equal(head, embed):
            config.tie_word_embeddings = False  # a head that differs from the embedding is what was trained
    with torch.device("meta"):
        model = CausalLM(training_class(config)(config))
    model.to_empty(device=device)
    tie_head(model, config)  # as training ties it
    if tensors is None:
        load_weights(model, where)
    else:
        missing = [n for n, _ in model.named_parameters() if n not in tensors]
        if missing:
            raise BadInput(
                f"{where}: holds no {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}; "
                "cannot build its model"
            )
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(tensors[n])
    model.to(dtype)
    reset_buffers(model, config, device)
    return model


def _finish(model, config, d: Path, fallback) -> Generator:
    """The Generator of ``model`` with DIR's tokenizer, its chat template (``fallback``: the data.template of a
    checkpoint older than chat_template.jinja) and its end tokens."""
    args = pretrained_tokenizer(d, config, "auto")  # the data builders' path: the same template, read alike
    given = args.get("tokenizer")
    if given is None:
        raise BadInput(f"{d}: no tokenizer.json; canntrain generate needs the model's tokenizer")
    hf = args.get("chat_template")
    fmt = None
    if hf is not None or fallback is not None:
        fmt = ChatFormat(given.tokenizer, given.eos_id, fallback or TemplateConfig(), hf)
    end_ids = [given.eos_id]
    gen_file = d / "generation_config.json"
    if gen_file.is_file():  # e.g. Llama 3's list: <|end_of_text|>, <|eom_id|>, <|eot_id|>
        try:
            eos = json.loads(gen_file.read_text()).get("eos_token_id")
            end_ids += [int(t) for t in (eos if isinstance(eos, list) else [eos]) if t is not None]
        except (ValueError, TypeError, AttributeError) as e:
            raise BadInput(f"{gen_file}: not a generation config ({e})") from None
    model.eval()
    return Generator(
        model,
        given.tokenizer,
        given.eos_id,
        tuple(dict.fromkeys(end_ids)),
        fmt,
        str(d),
        (fmt.source if hf is not None else "data.template") if fmt is not None else None,
    )
