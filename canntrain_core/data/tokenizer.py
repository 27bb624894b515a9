"""A byte-level BPE tokenizer trained locally on the corpus (DESIGN: no downloads), cached as JSON.

Byte-level means every string round-trips exactly (code with odd whitespace included) and no
token is ever unknown. One special token, ``<|endoftext|>``, separates documents and serves as EOS.
The cache key covers the corpus contents, the vocabulary size, the settings below and the
``tokenizers`` version, so the same inputs load the same file and anything else retrains.

A model directory's own tokenizer (``model.init_from``) comes through :func:`pretrained_tokenizer`, with its
special tokens and chat template; :func:`tokenizer_files` is what a checkpoint carries of them.
"""

from __future__ import annotations

import json
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from canntrain_core.data.cache import atomic_write_text, file_lock, key_of, sha256_text
from canntrain_core.data.corpus import Corpus
from canntrain_core.recipe import TokenizerConfig

EOS_TOKEN = "<|endoftext|>"

# Everything that shapes the trained tokenizer besides corpus and vocab size; bump `version`
# whenever this module changes how it trains, so old cache entries are not reused.
TOKENIZER_SETTINGS = {
    "version": 1,
    "model": "bpe",
    "pre_tokenizer": "byte_level(add_prefix_space=False, use_regex=True)",
    "special_tokens": [EOS_TOKEN],
    "min_frequency": 2,
}


@dataclass(frozen=True)
class TrainedTokenizer:
    tokenizer: Tokenizer
    path: Path
    sha256: str  # of the JSON file: identifies the tokenizer in pretokenize cache keys
    eos_id: int
    cache_hit: bool
    seconds: float
    # the transformers tokenizer of the directory it came from, when that directory has a tokenizer_config.json
    # or a chat template: its special tokens and chat template (checkpoints and exports carry them)
    hf: Any = None


class TokenText:
    """What every data bundle answers with its ``tokenizer`` (a tokenizers.Tokenizer): the text of token ids,
    special tokens shown, so that document and answer ends stay visible."""

    tokenizer: Tokenizer

    def decode(self, ids) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)


def new_byte_level_bpe() -> Tokenizer:
    """An untrained byte-level BPE tokenizer: GPT-2 style split, bytes mapped to printable chars."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    return tok


def train_tokenizer(corpus: Corpus, cfg: TokenizerConfig) -> Tokenizer:
    """Train a fresh tokenizer on `corpus` (no cache). Deterministic for a given corpus and config."""
    tok = new_byte_level_bpe()
    trainer = trainers.BpeTrainer(
        vocab_size=cfg.vocab_size,
        min_frequency=TOKENIZER_SETTINGS["min_frequency"],
        special_tokens=[EOS_TOKEN],  # first, so its id is 0
        # All 256 byte symbols up front: any byte sequence stays encodable even if unseen here.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus.texts(), trainer=trainer, length=corpus.n_documents)
    return tok


def tokenizer_cache_path(corpus: Corpus, cfg: TokenizerConfig, cache_dir: Path) -> Path:
    key = key_of(
        {
            "corpus": corpus.content_hash,
            "vocab_size": cfg.vocab_size,
            "type": cfg.type,
            "settings": TOKENIZER_SETTINGS,
            "tokenizers": tokenizers.__version__,
        }
    )
    return cache_dir / "tokenizers" / f"bpe-{cfg.vocab_size}-{key}.json"


def get_tokenizer(corpus: Corpus, cfg: TokenizerConfig, cache_dir: Path) -> TrainedTokenizer:
    """Load the tokenizer for (corpus, cfg) from the cache, training and caching it on a miss."""
    path = tokenizer_cache_path(corpus, cfg, cache_dir)
    start = time.perf_counter()
    with file_lock(path.with_suffix(".lock")):
        hit = path.is_file()
        if hit:
            text = path.read_text(encoding="utf-8")
        else:
            text = train_tokenizer(corpus, cfg).to_str()
            atomic_write_text(path, text)
    tok = Tokenizer.from_str(text)
    eos_id = tok.token_to_id(EOS_TOKEN)
    if eos_id is None:  # a hand-edited or foreign file in the cache
        raise ValueError(f"{path}: tokenizer has no {EOS_TOKEN} token; delete the file to retrain")
    return TrainedTokenizer(tok, path, sha256_text(text), eos_id, hit, time.perf_counter() - start)


CHAT_TEMPLATE_FILE = "chat_template.jinja"  # where transformers' save_pretrained puts a chat template
CHAT_TEMPLATE_DIR = "additional_chat_templates"  # ... and the named ones beside the default


def chat_template_source(directory: str | Path) -> Path | None:
    """Where DIR keeps its chat template, wherever transformers reads one: ``chat_template.jinja``,
    ``additional_chat_templates/*.jinja``, or ``tokenizer_config.json``'s ``chat_template`` (a string or a
    list of named templates). None when it has none."""
    d = Path(directory)
    if (d / CHAT_TEMPLATE_FILE).is_file():
        return d / CHAT_TEMPLATE_FILE
    if (d / CHAT_TEMPLATE_DIR).is_dir() and any((d / CHAT_TEMPLATE_DIR).glob("*.jinja")):
        return d / CHAT_TEMPLATE_DIR
    cfg = d / "tokenizer_config.json"
    try:
        fields = json.loads(cfg.read_text(encoding="utf-8")) if cfg.is_file() else {}
    except (ValueError, UnicodeDecodeError):
        fields = {}  # transformers reports a broken file when it loads it
    return cfg if isinstance(fields, dict) and fields.get("chat_template") else None


def _transformers_tokenizer(directory: Path):
    """DIR's tokenizer as transformers loads it (special tokens, chat templates), when DIR says more than
    tokenizer.json does; None otherwise (nothing to load)."""
    from canntrain_core.data.cache import DataError

    if not (directory / "tokenizer_config.json").is_file() and chat_template_source(directory) is None:
        return None
    from transformers import PreTrainedTokenizerFast

    try:
        return PreTrainedTokenizerFast.from_pretrained(str(directory))
    except (OSError, ValueError, TypeError) as e:
        raise DataError(f"{directory}: transformers cannot load its tokenizer ({e})") from None


def pretrained_tokenizer(init_from: str | Path | None, config, chat_template: str | None = None) -> dict:
    """The data builders' extra arguments for a model from a Hugging Face directory (``model.init_from``;
    for ``canntrain generate`` also a checkpoint or an export): its own tokenizer.json when it has one, and
    the model's vocabulary size either way. With ``chat_template`` (``data.chat_template``: auto, tokenizer
    or recipe; stages that format conversations), also ``chat_template``: the transformers tokenizer whose
    chat template formats them, or None where ``data.template`` does.

    The one path that loads a pretrained tokenizer and its chat template (SFT, reward, DPO, GRPO, PPO
    and ``canntrain generate`` all come through here)."""
    from canntrain_core.data.cache import DataError
    from canntrain_core.models.hf import tokenizer_eos

    if not init_from:
        if chat_template == "tokenizer":
            raise DataError(
                "data.chat_template=tokenizer: there is no tokenizer to take it from (model.init_from "
                "is not set); use data.chat_template=recipe (data.template) or auto"
            )
        return {}
    d = Path(init_from)
    path = d / "tokenizer.json"
    if not path.is_file():
        if chat_template == "tokenizer":
            raise DataError(f"data.chat_template=tokenizer: {d} has no tokenizer.json; use data.chat_template=recipe")
        return {"vocab_size": config.vocab_size, **({"chat_template": None} if chat_template else {})}
    start = time.perf_counter()
    text = path.read_text(encoding="utf-8")
    try:
        tok = Tokenizer.from_str(text)
    except Exception as e:  # tokenizers raises a bare Exception for a malformed file
        raise DataError(f"{path}: not a tokenizers tokenizer.json ({e})") from None
    eos_id = tokenizer_eos(init_from, config, tok)
    hf = _transformers_tokenizer(d)
    given = TrainedTokenizer(tok, path, sha256_text(text), eos_id, True, time.perf_counter() - start, hf)
    out = {"tokenizer": given, "vocab_size": config.vocab_size}
    if chat_template is not None:
        has = hf is not None and bool(hf.chat_template)
        if chat_template == "tokenizer" and not has:
            raise DataError(
                f"data.chat_template=tokenizer: {d} has no chat template ({CHAT_TEMPLATE_FILE}, "
                f"{CHAT_TEMPLATE_DIR}/ or tokenizer_config.json's chat_template); use "
                "data.chat_template=recipe (data.template)"
            )
        out["chat_template"] = hf if has and chat_template != "recipe" else None
    return out


def tokenizer_files(
    tokenizer: Tokenizer,
    eos_id: int | None,
    source=None,
    chat_template: str | dict | None = None,
    model_max_length: int | None = None,
) -> dict[str, str]:
    """The small files transformers' ``save_pretrained`` writes beside tokenizer.json (tokenizer_config.json,
    chat_template.jinja, additional_chat_templates/NAME.jinja), as {relative path: text}: what a checkpoint
    carries so that its export loads with the special tokens and chat template the run used.

    ``source``: the transformers tokenizer the run started from (:attr:`TrainedTokenizer.hf`), whose special
    tokens (bos, eos, pad, unk, ...) are kept; without one, ``eos_id``'s token is the only special token.
    ``chat_template``: the template the run formatted conversations with (None: none)."""
    from transformers import PreTrainedTokenizerFast

    if source is not None:
        specials = {k: v for k, v in source.special_tokens_map.items() if k != "additional_special_tokens"}
        kwargs = {**specials, "model_max_length": source.model_max_length}
        extra = getattr(source, "extra_special_tokens", None)  # named special tokens beyond bos/eos/pad/unk
        if extra:
            kwargs["extra_special_tokens"] = extra
    else:
        eos = tokenizer.id_to_token(eos_id) if eos_id is not None else None
        kwargs = {"eos_token": eos} if eos is not None else {}
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, **kwargs)
    if model_max_length and fast.model_max_length > 10**12:  # transformers' "no limit" sentinel
        fast.model_max_length = model_max_length
    fast.chat_template = chat_template
    with tempfile.TemporaryDirectory() as tmp:
        fast.save_pretrained(tmp)
        root = Path(tmp)
        return {
            str(p.relative_to(root)): p.read_text(encoding="utf-8")
            for p in sorted(root.rglob("*"))
            if p.is_file() and p.name != "tokenizer.json"
        }
