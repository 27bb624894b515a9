"""Megatron's indexed format both ways, with megatron-core's own reader and writer: Megatron-LM and MindSpeed-LLM
read the shards ``canntrain prepare`` writes, and canntrain trains on what Megatron's ``IndexedDatasetBuilder``
writes (its ``preprocess_data.py`` path)."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
import torch

from canntrain_core.data import DataError, PrepareOptions, build_data, open_prepared, prepare, train_tokenizer
from canntrain_core.recipe import DataConfig, TokenizerConfig

pytestmark = pytest.mark.slow  # importing megatron-core takes seconds: the full suite checks the format


@pytest.fixture(scope="module")
def megatron():
    """megatron-core's indexed dataset module, imported when a test here runs (not when test-fast collects)."""
    with warnings.catch_warnings():  # megatron-core warns that Apex and Transformer Engine are absent: not used here
        warnings.simplefilter("ignore")
        from megatron.core.datasets import indexed_dataset
    return indexed_dataset


TEXTS = [f"document {i}: " + " ".join(["token"] * (i % 13) + ["end"]) for i in range(200)]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    (d / "tokenizer.json").write_text(train_tokenizer(TEXTS, 300).to_str())
    return d


def test_megatron_reads_canntrain_shards(megatron, tokenizer_dir, tmp_path):
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    prepare([str(src)], tmp_path / "out", tokenizer=tokenizer_dir, opts=PrepareOptions(unit_bytes=2048), progress=False)
    data = open_prepared(tmp_path / "out")
    assert len(data.shards) > 2
    for ours in data.shards:
        theirs = megatron.IndexedDataset(str(ours.prefix))
        assert len(theirs) == ours.n_documents
        assert theirs.index.dtype == np.uint16
        assert np.array_equal(theirs.sequence_lengths, ours.sequence_lengths)
        assert np.array_equal(theirs.document_indices, np.arange(ours.n_documents + 1))
        for d in range(ours.n_documents):
            assert np.array_equal(theirs[d], ours.document(d))


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_canntrain_trains_on_what_megatron_wrote(megatron, tokenizer_dir, tmp_path, dtype):
    from canntrain_core.data import load_tokenizer_dir

    tok = load_tokenizer_dir(tokenizer_dir)
    docs = [tok.tokenizer.encode(t).ids + [tok.eos_id] for t in TEXTS]
    builder = megatron.IndexedDatasetBuilder(str(tmp_path / "corpus_text_document.bin"), dtype=dtype)
    for d in docs:
        builder.add_document(np.asarray(d), [len(d)])  # (its own preprocess_data passes lists too)
    builder.finalize(str(tmp_path / "corpus_text_document.idx"))
    prefix = tmp_path / "corpus_text_document"
    cfg = DataConfig(source=str(prefix), seq_length=16, val_fraction=0.0, cache_dir=str(tmp_path / "c"))
    with pytest.raises(DataError, match=r"Megatron data carries no tokenizer; name the one it was made with"):
        build_data(cfg, seed=0)
    cfg = cfg.model_copy(update={"tokenizer": TokenizerConfig(path=str(tokenizer_dir))})
    b = build_data(cfg, seed=0)
    stream = np.concatenate(docs)
    assert b.info["train_tokens"] == len(stream) and b.info["tokenizer_source"] == "path"
    assert torch.equal(b.train[3], torch.from_numpy(stream[48:65]))  # sample 3: tokens 3*16 .. 3*16+16
    # with a held-out split, the documents are divided whole between the two
    held = build_data(cfg.model_copy(update={"val_fraction": 0.2}), seed=0)
    assert held.info["train_tokens"] + held.info["val_tokens"] == len(stream) and held.info["val_tokens"] > 0
