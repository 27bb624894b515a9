"""Tokenizers: a pretrained one on disk, or a byte-level BPE trained locally on a sample of the corpus
(nothing is downloaded at run time), cached as JSON.

A pretrained tokenizer is a directory with ``tokenizer.json`` (read by ``tokenizers``) or only a SentencePiece
``tokenizer.model`` (converted by transformers, which needs ``sentencepiece``): :func:`load_tokenizer_dir`.
Its EOS is ``tokenizer_config.json``'s ``eos_token`` (else the model's ``eos_token_id``).

A trained one is byte-level, so every string round-trips exactly (code with odd whitespace included) and no
token is ever unknown; one special token, ``<|endoftext|>``, separates documents and serves as EOS. It trains on
at most ``data.tokenizer.sample_bytes`` of text spread over the corpus, never on the whole corpus, and is cached
under a key of that sample's sources, the vocabulary size, the settings below and the ``tokenizers`` version.

A model directory's own tokenizer (``model.init_from``) comes through :func:`pretrained_tokenizer`, with its
special tokens and chat template; :func:`tokenizer_files` is what a checkpoint carries of them.
"""

from __future__ import annotations

import functools
import json
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import tokenizers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from canntrain_core.data.cache import DataError, atomic_write_text, file_lock, key_of, sha256_text
from canntrain_core.recipe import TokenizerConfig

EOS_TOKEN = "<|endoftext|>"

# Everything that shapes the trained tokenizer besides its sample and vocab size; bump `version`
# whenever this module changes how it trains, so old cache entries are not reused.
TOKENIZER_SETTINGS = {
    "version": 2,
    "model": "bpe",
    "pre_tokenizer": "byte_level(add_prefix_space=False, use_regex=True)",
    "special_tokens": [EOS_TOKEN],
    "min_frequency": 2,
}


@dataclass(frozen=True)
class TrainedTokenizer:
    tokenizer: Tokenizer
    path: Path
    sha256: str  # of tokenizer.to_str(): the tokenizer's identity (prepared data and models compare it)
    eos_id: int
    cache_hit: bool
    seconds: float
    # the transformers tokenizer of the directory it came from, when that directory has a tokenizer_config.json
    # or a chat template: its special tokens and chat template (checkpoints and exports carry them)
    hf: Any = None

    @property
    def directory(self) -> Path:
        return self.path.parent


class TokenText:
    """What every data bundle answers with its ``tokenizer`` (a tokenizers.Tokenizer): the text of token ids,
    special tokens shown, so that document and answer ends stay visible."""

    tokenizer: Tokenizer

    def decode(self, ids) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)


def tokenizer_identity(tok: Tokenizer) -> str:
    """sha256 of the tokenizer's canonical JSON: equal for the same vocabulary, merges and rules however the
    file was formatted (a copy in a prepared dataset, a model directory, a conversion from SentencePiece)."""
    return sha256_text(tok.to_str())


def new_byte_level_bpe() -> Tokenizer:
    """An untrained byte-level BPE tokenizer: GPT-2 style split, bytes mapped to printable chars."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    return tok


def transformers_pipeline(model_type: str | None) -> dict | None:
    """The normalizer and pre-tokenizer (as tokenizers' JSON) that transformers' ``AutoTokenizer`` imposes on a
    byte-level BPE exported with ``model_type`` (Qwen2Tokenizer rebuilds its own, whatever tokenizer.json
    says), or None where it reads tokenizer.json as written. Found by asking AutoTokenizer, not from a list."""
    if not model_type:
        return None
    return _imposed_pipeline(model_type)


@functools.lru_cache(maxsize=None)
def _imposed_pipeline(model_type: str) -> dict | None:
    # deferred: start-up time (transformers' tokenizer classes load sentencepiece, ~20 ms; --help imports this)
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    tok = train_tokenizer(["a b"], 300)
    with tempfile.TemporaryDirectory() as tmp:
        PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN).save_pretrained(tmp)
        Path(tmp, "config.json").write_text(json.dumps({"model_type": model_type}))
        try:
            backend = AutoTokenizer.from_pretrained(tmp).backend_tokenizer
        except (OSError, ValueError, TypeError, KeyError, AttributeError):
            return None  # a model type transformers builds no tokenizer for: tokenizer.json is what it gets
    if _pieces(backend, PROBE_TEXT) == _pieces(tok, PROBE_TEXT):
        return None
    as_json = json.loads(backend.to_str())
    return {"normalizer": as_json.get("normalizer"), "pre_tokenizer": as_json.get("pre_tokenizer")}


def train_tokenizer(texts: list[str], vocab_size: int, pipeline: dict | None = None) -> Tokenizer:
    """Train a fresh byte-level BPE on ``texts`` (no cache). Deterministic for the same texts and size.
    ``pipeline``: the normalizer and pre-tokenizer to train it with (:func:`transformers_pipeline`)."""
    tok = new_byte_level_bpe()
    if pipeline is not None:
        shape = json.loads(tok.to_str())
        shape.update(pipeline)
        tok = Tokenizer.from_str(json.dumps(shape))
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=TOKENIZER_SETTINGS["min_frequency"],
        special_tokens=[EOS_TOKEN],  # first, so its id is 0
        # All 256 byte symbols up front: any byte sequence stays encodable even if unseen here.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


def trained_tokenizer_path(sample_key: str, cfg: TokenizerConfig, cache_dir: Path, pipeline=None) -> Path:
    """Where the tokenizer trained on the sample named by ``sample_key`` with ``cfg`` is cached."""
    key = key_of(
        {
            "sample": sample_key,
            **({"pipeline": pipeline} if pipeline is not None else {}),
            "vocab_size": cfg.vocab_size,
            "sample_bytes": cfg.sample_bytes,
            "type": cfg.type,
            "settings": TOKENIZER_SETTINGS,
            "tokenizers": tokenizers.__version__,
        }
    )
    return cache_dir / "tokenizers" / f"bpe-{cfg.vocab_size}-{key}.json"


def get_tokenizer(
    sample_key: str,
    texts: Callable[[], list[str]],
    cfg: TokenizerConfig,
    cache_dir: Path,
    model_type: str | None = None,
) -> TrainedTokenizer:
    """The tokenizer trained on ``texts()`` (called only on a cache miss) with ``cfg``, cached under
    ``sample_key`` (what names the sample: its sources' listing, never their contents). ``model_type``: the
    model it is for, whose export transformers may read with its own pre-tokenizer (:func:`transformers_pipeline`):
    then it is trained with that one, so that the export's ids are the ones trained on."""
    pipeline = transformers_pipeline(model_type)
    path = trained_tokenizer_path(sample_key, cfg, cache_dir, pipeline)
    start = time.perf_counter()
    with file_lock(path.with_suffix(".lock")):
        hit = path.is_file()
        if hit:
            text = path.read_text(encoding="utf-8")
        else:
            text = train_tokenizer(texts(), cfg.vocab_size, pipeline).to_str()
            atomic_write_text(path, text)
    tok = Tokenizer.from_str(text)
    eos_id = tok.token_to_id(EOS_TOKEN)
    if eos_id is None:  # a hand-edited or foreign file in the cache
        raise DataError(f"{path}: tokenizer has no {EOS_TOKEN} token; delete the file to retrain")
    return TrainedTokenizer(tok, path, sha256_text(text), eos_id, hit, time.perf_counter() - start)


def load_tokenizer_dir(
    directory: str | Path, fallback_eos: int | None = None, what: str = "tokenizer"
) -> TrainedTokenizer:
    """The pretrained tokenizer in ``directory`` (see the module docstring). Its EOS: tokenizer_config.json's
    eos_token, else ``fallback_eos`` (a model's config.json), else ``<|endoftext|>`` when it has one (a tokenizer
    trained here). A DataError names the directory and what is wrong, in one line."""
    d = Path(directory).expanduser()
    start = time.perf_counter()
    if not d.is_dir():
        raise DataError(f"{what}: {d} is not a directory (it should hold tokenizer.json or tokenizer.model)")
    path = d / "tokenizer.json"
    if path.is_file():
        try:
            tok = Tokenizer.from_str(path.read_text(encoding="utf-8"))
        except Exception as e:  # tokenizers raises a bare Exception for a malformed file
            raise DataError(f"{path}: not a tokenizers tokenizer.json ({str(e)[:200]})") from None
        hf = _transformers_tokenizer(d)
        check_agrees_with_transformers(d, tok)
    elif (d / "tokenizer.model").is_file():
        hf = _from_sentencepiece(d)
        tok, path = hf.backend_tokenizer, d / "tokenizer.model"
    else:
        raise DataError(f"{what}: {d} holds neither tokenizer.json nor tokenizer.model")
    eos_id = _config_eos(d, tok)
    if eos_id is None:
        eos_id = fallback_eos if fallback_eos is not None else tok.token_to_id(EOS_TOKEN)
    if eos_id is None:
        raise DataError(
            f"{d}: no EOS token (tokenizer_config.json's eos_token, or the model's eos_token_id): documents need "
            "one between them; add eos_token to tokenizer_config.json"
        )
    return TrainedTokenizer(tok, path, tokenizer_identity(tok), int(eos_id), True, time.perf_counter() - start, hf)


# Code, prose, digit runs, odd whitespace, a decomposed accent and three scripts: where a normalizer or a
# pre-tokenizer differs, some of these split differently.
PROBE_TEXT = (
    "def f(x_1, y=2.50):\n\treturn {'a': [x_1 ** 2]}  # it's   DONE\r\n\n"
    "Ünïcödé cafe\u0301, naïve — 東京は晴れ。 Привет, мир! 12345678 +3.14e-10 \u00a0end  "
)


def _pieces(tok: Tokenizer, text: str) -> list[str]:
    """``text`` as ``tok`` splits it before its model sees it (normalizer, then pre-tokenizer)."""
    if tok.normalizer is not None:
        text = tok.normalizer.normalize_str(text)
    if tok.pre_tokenizer is None:
        return [text]
    return [piece for piece, _ in tok.pre_tokenizer.pre_tokenize_str(text)]


def check_agrees_with_transformers(d: Path, tok: Tokenizer) -> None:
    """Refuse ``d`` when transformers' ``AutoTokenizer`` (the class of config.json's model_type or of
    tokenizer_config.json's tokenizer_class, which may rebuild the normalizer and pre-tokenizer, as
    Qwen2Tokenizer does) and ``tokenizer.json`` as written split or encode :data:`PROBE_TEXT` differently:
    canntrain would train on ids that the export is never given by transformers."""
    if not (d / "tokenizer_config.json").is_file() and not (d / "config.json").is_file():
        return  # nothing tells transformers to build anything but tokenizer.json itself
    # deferred: start-up time (transformers' tokenizer classes load sentencepiece, ~20 ms; --help imports this)
    from transformers import AutoTokenizer

    try:
        theirs = AutoTokenizer.from_pretrained(str(d))
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise DataError(f"{d}: transformers' AutoTokenizer cannot load this tokenizer ({str(e)[:200]})") from None
    backend = getattr(theirs, "backend_tokenizer", None)
    ours, got = tok.encode(PROBE_TEXT).ids, theirs(PROBE_TEXT)["input_ids"]
    theirs_split, ours_split = (
        (_pieces(backend, PROBE_TEXT), _pieces(tok, PROBE_TEXT)) if backend is not None else ([], [])
    )
    what = None
    if ours != got:
        at = next((i for i, (a, b) in enumerate(zip(ours, got)) if a != b), min(len(ours), len(got)))
        what = f"token {at} is {got[at : at + 1]} there and {ours[at : at + 1]} here"
    elif theirs_split != ours_split:
        a, b = theirs_split, ours_split
        at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        what = f"it splits a probe text otherwise: {a[at : at + 2]} there, {b[at : at + 2]} here"
    if what:
        raise DataError(
            f"{d}: transformers' AutoTokenizer ({type(theirs).__name__}) does not tokenize as tokenizer.json does "
            f"({what}): the model would train on ids its export is never given. Save the tokenizer with that "
            "class's save_pretrained so that tokenizer.json is what transformers builds"
        )


def _config_eos(d: Path, tok: Tokenizer) -> int | None:
    cfg_path = d / "tokenizer_config.json"
    if not cfg_path.is_file():
        return None
    try:
        eos = json.loads(cfg_path.read_text(encoding="utf-8")).get("eos_token")
    except (ValueError, UnicodeDecodeError, AttributeError):
        raise DataError(f"{cfg_path}: not a JSON object") from None
    if isinstance(eos, dict):  # {"content": "</s>", ...}
        eos = eos.get("content")
    return tok.token_to_id(eos) if isinstance(eos, str) else None


def _from_sentencepiece(d: Path):
    """transformers' fast tokenizer converted from a SentencePiece ``tokenizer.model`` (needs sentencepiece)."""
    # deferred: start-up time (transformers' tokenizer classes load sentencepiece, ~20 ms; --help imports this)
    from transformers import AutoTokenizer

    try:
        fast = AutoTokenizer.from_pretrained(str(d), use_fast=True)
    except (ImportError, OSError, ValueError, TypeError) as e:
        raise DataError(
            f"{d / 'tokenizer.model'}: transformers cannot convert this SentencePiece model ({str(e)[:200]}); "
            "it needs the sentencepiece package, or give a directory with tokenizer.json"
        ) from None
    if getattr(fast, "backend_tokenizer", None) is None:
        raise DataError(f"{d / 'tokenizer.model'}: transformers gave no fast tokenizer for it")
    return fast


def resolved_vocab_size(cfg, tokenizer_size: int | None) -> int:
    """The model's embedding rows: ``data.tokenizer.vocab_size`` when the recipe sets it (at least the
    tokenizer's size), else the pretrained or prepared tokenizer's own size, else the default for a BPE
    trained here."""
    tc = cfg.tokenizer
    if "vocab_size" in tc.model_fields_set or tokenizer_size is None:
        if tokenizer_size is not None and tc.vocab_size < tokenizer_size:
            raise DataError(
                f"data.tokenizer.vocab_size={tc.vocab_size} is smaller than the tokenizer's {tokenizer_size} tokens; "
                f"set it to {tokenizer_size} or more (or leave it out to take the tokenizer's size)"
            )
        return tc.vocab_size
    return tokenizer_size


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
    if not (directory / "tokenizer_config.json").is_file() and chat_template_source(directory) is None:
        return None
    # deferred: start-up time (transformers' tokenizer classes load sentencepiece, ~20 ms; --help imports this)
    from transformers import PreTrainedTokenizerFast

    try:
        return PreTrainedTokenizerFast.from_pretrained(str(directory))
    except (OSError, ValueError, TypeError) as e:
        raise DataError(f"{directory}: transformers cannot load its tokenizer ({e})") from None


def pretrained_tokenizer(
    init_from: str | Path | None, config, chat_template: str | None = None, tokenizer_path: str | None = None
) -> dict:
    """The data builders' extra arguments for a model from a Hugging Face directory (``model.init_from``;
    for ``canntrain generate`` also a checkpoint or an export): its own tokenizer (tokenizer.json or a SentencePiece
    tokenizer.model), else ``tokenizer_path``'s (``data.tokenizer.path``), else a DataError (a tokenizer trained here
    would give the pretrained embeddings other tokens); and the model's vocabulary size. With ``chat_template``
    (``data.chat_template``: auto, tokenizer or recipe; stages that format conversations), also ``chat_template``:
    the transformers tokenizer whose chat template formats them, or None where ``data.template`` does.

    The one path that loads a pretrained tokenizer and its chat template (SFT, reward, DPO, GRPO, PPO
    and ``canntrain generate`` all come through here)."""
    if not init_from:
        if chat_template == "tokenizer":
            raise DataError(
                "data.chat_template=tokenizer: there is no tokenizer to take it from (model.init_from "
                "is not set); use data.chat_template=recipe (data.template) or auto"
            )
        return {}
    d = Path(init_from)
    eos = config.eos_token_id[0] if isinstance(config.eos_token_id, list) else config.eos_token_id
    if not (d / "tokenizer.json").is_file() and not (d / "tokenizer.model").is_file():
        if tokenizer_path is None:  # a new tokenizer would give every embedding row another token
            raise DataError(
                f"model.init_from: {d} holds no tokenizer (tokenizer.json or tokenizer.model); its embeddings mean "
                "its own tokenizer's ids: copy the model's tokenizer there, or name it with data.tokenizer.path"
            )
        d = Path(tokenizer_path)
    given = load_tokenizer_dir(d, eos, what="model.init_from")
    hf = given.hf
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
    # deferred: start-up time (transformers' tokenizer classes load sentencepiece, ~20 ms; --help imports this)
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
