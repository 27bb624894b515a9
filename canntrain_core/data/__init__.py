"""Data: raw sources -> ``canntrain prepare`` (tokenizer, Megatron-format shards, manifest) -> split windows
over the prepared tokens -> a resumable sampler over one source or a weighted mixture.

Notebooks and the trainer call :func:`build_data`; ``canntrain prepare`` calls :func:`prepare`; the pieces are
importable for tests and tinkering.
"""

from canntrain_core.data.cache import DataError, resolve_cache_dir
from canntrain_core.data.indexed import IndexedTokens, ShardWriter, token_dtype
from canntrain_core.data.pipeline import DataBundle, build_data
from canntrain_core.data.prepare import PrepareOptions, prepare
from canntrain_core.data.prepared import TokenWindows, open_prepared
from canntrain_core.data.sampler import ResumableSampler
from canntrain_core.data.tokenizer import (
    EOS_TOKEN,
    TrainedTokenizer,
    load_tokenizer_dir,
    pretrained_tokenizer,
    train_tokenizer,
)

__all__ = [
    "EOS_TOKEN",
    "DataBundle",
    "DataError",
    "IndexedTokens",
    "PrepareOptions",
    "ResumableSampler",
    "ShardWriter",
    "TokenWindows",
    "TrainedTokenizer",
    "build_data",
    "load_tokenizer_dir",
    "open_prepared",
    "prepare",
    "pretrained_tokenizer",
    "resolve_cache_dir",
    "token_dtype",
    "train_tokenizer",
]
