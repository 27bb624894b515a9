"""Data: corpus -> byte-level BPE tokenizer -> pretokenized memmaps -> packed datasets + resumable sampler.

Notebooks and the trainer call :func:`build_data`; the pieces are importable for tests and tinkering.
"""

from canntrain_core.data.cache import DataError, resolve_cache_dir
from canntrain_core.data.corpus import Corpus, Document, load_corpus
from canntrain_core.data.dataset import PackedDataset
from canntrain_core.data.pipeline import DataBundle, build_data
from canntrain_core.data.pretokenize import Pretokenized, pretokenize, split_documents, token_dtype
from canntrain_core.data.sampler import ResumableSampler
from canntrain_core.data.tokenizer import (
    EOS_TOKEN,
    TrainedTokenizer,
    get_tokenizer,
    pretrained_tokenizer,
    train_tokenizer,
)

__all__ = [
    "EOS_TOKEN",
    "Corpus",
    "DataBundle",
    "DataError",
    "Document",
    "PackedDataset",
    "Pretokenized",
    "ResumableSampler",
    "TrainedTokenizer",
    "build_data",
    "get_tokenizer",
    "pretrained_tokenizer",
    "load_corpus",
    "pretokenize",
    "resolve_cache_dir",
    "split_documents",
    "token_dtype",
    "train_tokenizer",
]
