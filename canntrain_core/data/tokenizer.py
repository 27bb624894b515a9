"""A byte-level BPE tokenizer trained locally on the corpus (DESIGN: no downloads), cached as JSON.

Byte-level means every string round-trips exactly (code with odd whitespace included) and no
token is ever unknown. One special token, ``<|endoftext|>``, separates documents and serves as EOS.
The cache key covers the corpus contents, the vocabulary size, the settings below and the
``tokenizers`` version, so the same inputs load the same file and anything else retrains.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

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


def pretrained_tokenizer(init_from: str | None, config) -> dict:
    """``build_data``'s extra arguments for a model from a Hugging Face directory (``model.init_from``):
    its own tokenizer.json when it has one, and the model's vocabulary size either way."""
    from canntrain_core.data.cache import DataError
    from canntrain_core.models.hf import tokenizer_eos

    if not init_from:
        return {}
    path = Path(init_from) / "tokenizer.json"
    if not path.is_file():
        return {"vocab_size": config.vocab_size}
    start = time.perf_counter()
    text = path.read_text(encoding="utf-8")
    try:
        tok = Tokenizer.from_str(text)
    except Exception as e:  # tokenizers raises a bare Exception for a malformed file
        raise DataError(f"{path}: not a tokenizers tokenizer.json ({e})") from None
    eos_id = tokenizer_eos(init_from, config, tok)
    given = TrainedTokenizer(tok, path, sha256_text(text), eos_id, True, time.perf_counter() - start)
    return {"tokenizer": given, "vocab_size": config.vocab_size}
