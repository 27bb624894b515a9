"""Data pipeline: real corpus (a small stdlib subset), real tokenizer training, real memmaps and DataLoaders."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from canntrain_core.data import (
    DataError,
    EOS_TOKEN,
    PackedDataset,
    ResumableSampler,
    build_data,
    load_corpus,
    split_documents,
)
from canntrain_core.recipe import DataConfig, TokenizerConfig

SMALL = 200_000  # bytes of stdlib: tokenizer + pretokenize well under a second each


def small_cfg(cache_dir: Path, **kw) -> DataConfig:
    base = dict(
        max_bytes=SMALL,
        tokenizer=TokenizerConfig(vocab_size=512),
        seq_length=32,
        batch_size=4,
        val_fraction=0.1,
        cache_dir=str(cache_dir),
    )
    base.update(kw)
    return DataConfig(**base)


@pytest.fixture(scope="module")
def cache_a(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache_a")


@pytest.fixture(scope="module")
def bundle(cache_a):
    return build_data(small_cfg(cache_a), seed=7)


# ---------------------------------------------------------------------------- corpus


def test_stdlib_cap_is_deterministic_spread_and_within_budget():
    a = load_corpus(max_bytes=SMALL)
    b = load_corpus(max_bytes=SMALL)
    assert [d.name for d in a.documents] == [d.name for d in b.documents]
    assert a.files_hash == b.files_hash and a.content_hash == b.content_hash
    assert 0.8 * SMALL < a.n_bytes <= SMALL
    names = [d.name for d in a.documents]
    assert names == sorted(names)
    assert all(n.endswith(".py") and "site-packages" not in n for n in names)
    # Spread out, not the alphabetically first files of the stdlib.
    full_first = sorted(d.name for d in load_corpus(max_files=10_000).documents)[: len(names)]
    assert names != full_first
    few = load_corpus(max_files=3)
    assert few.n_documents == 3


def test_directory_source(tmp_path):
    root = tmp_path / "texts"
    (root / "sub").mkdir(parents=True)
    (root / ".git").mkdir()
    (root / "b.txt").write_text("second file\n")
    (root / "a.md").write_text("# first\n")
    (root / "sub" / "c.py").write_text("print('hi')\n")
    (root / ".git" / "config").write_text("hidden, skipped\n")
    (root / "image.bin").write_bytes(b"\x89PNG\x00\x01\x02")  # binary: skipped
    (root / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))  # not UTF-8: skipped
    (root / "empty.txt").write_text("")
    corpus = load_corpus(str(root), on_bad_record="skip")
    assert [d.name for d in corpus.documents] == ["a.md", "b.txt", "sub/c.py"]
    assert corpus.n_bytes == len("# first\n") + len("second file\n") + len("print('hi')\n")
    assert corpus.bad_records == (
        "image.bin: a binary file (NUL byte at byte 4), not text",
        "latin1.txt: not UTF-8 (unexpected end of data, byte 0xe9 at byte 3)",
    )


def test_jsonl_source_and_errors(tmp_path):
    good = tmp_path / "good.jsonl"
    good.write_text('{"body": "one"}\n\n{"body": "two", "x": 1}\n')
    corpus = load_corpus(str(good), text_field="body")
    assert corpus.texts() == ["one", "two"]
    assert [d.name for d in corpus.documents] == ["good.jsonl:1", "good.jsonl:3"]

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"text": "broken"\n')
    with pytest.raises(DataError, match=r"bad\.jsonl, line 2: invalid JSON"):
        load_corpus(str(bad))

    nokey = tmp_path / "nokey.jsonl"
    nokey.write_text('{"text": "ok"}\n{"text": "ok"}\n{"content": "x"}\n')
    with pytest.raises(DataError, match=r"nokey\.jsonl, line 3: record has no key 'text'"):
        load_corpus(str(nokey))


def test_bad_jsonl_records_are_skipped_and_counted(tmp_path):
    src = tmp_path / "mixed.jsonl"
    src.write_text('{"text": "one"}\n{"text": "broken"\n{"text": "two"}\n{"body": "no text key"}\n{"text": "three"}\n')
    with pytest.raises(DataError, match=r"mixed\.jsonl, line 2: invalid JSON.*data\.on_bad_record=skip"):
        load_corpus(str(src))
    b = build_data(
        small_cfg(
            tmp_path / "cache",
            source=str(src),
            max_bytes=None,
            on_bad_record="skip",
            tokenizer=TokenizerConfig(vocab_size=260),
            seq_length=2,
            val_fraction=0.0,
        ),
        seed=0,
    )
    assert b.info["corpus_documents"] == 3 and b.info["bad_records"] == 2
    examples = b.info["bad_record_examples"]
    assert len(examples) == 2
    assert examples[0].startswith("mixed.jsonl:2: invalid JSON")
    assert examples[1].startswith("mixed.jsonl:4: record has no key 'text'")
    # The kept records keep their line numbers as names, so the cache keys (which hash the kept
    # documents) change only when a kept document does.
    corpus = load_corpus(str(src), on_bad_record="skip")
    assert [d.name for d in corpus.documents] == ["mixed.jsonl:1", "mixed.jsonl:3", "mixed.jsonl:5"]
    src.write_text('{"text": "one"}\n{"text": "broken"\n{"text": "two"}\n{"body": "no text key"}\n{"text": "3"}\n')
    assert load_corpus(str(src), on_bad_record="skip").content_hash != corpus.content_hash


def test_bad_files_in_a_text_directory(tmp_path):
    root = tmp_path / "texts"
    root.mkdir()
    (root / "good.txt").write_text("plain text\n")
    (root / "latin1.txt").write_bytes("na\xefve caf\xe9\n".encode("latin-1"))
    with pytest.raises(
        DataError, match=r"texts/latin1\.txt: not UTF-8 \(invalid continuation byte, byte 0xef at byte 2\)"
    ):
        load_corpus(str(root))
    corpus = load_corpus(str(root), on_bad_record="skip")
    assert corpus.texts() == ["plain text\n"]
    assert corpus.bad_records == ("latin1.txt: not UTF-8 (invalid continuation byte, byte 0xef at byte 2)",)
    # Nothing usable left: one clear error before a tokenizer would train on nothing.
    (root / "good.txt").unlink()
    with pytest.raises(DataError, match=r"no usable documents in .*skipped 1 bad record\(s\)/file\(s\): latin1\.txt"):
        load_corpus(str(root), on_bad_record="skip")


def test_stdlib_non_utf8_test_files_are_skipped_and_counted_whatever_the_policy(tmp_path, monkeypatch):
    # A stand-in stdlib (some installs ship it without test/, where the real latin-1 files live).
    (tmp_path / "test").mkdir()
    (tmp_path / "abc.py").write_text("x = 1\n")
    (tmp_path / "test" / "latin1.py").write_bytes(b"# -*- coding: latin-1 -*-\ns = 'caf\xe9'\n")
    monkeypatch.setattr("canntrain_core.data.corpus.stdlib_dir", lambda: tmp_path)
    corpus = load_corpus("stdlib", on_bad_record="error")
    assert [d.name for d in corpus.documents] == ["abc.py"]
    assert corpus.bad_records == ("test/latin1.py: not UTF-8 (invalid continuation byte, byte 0xe9 at byte 34)",)


def test_jsonl_corpus_end_to_end_keeps_literal_eos_as_text(tmp_path):
    texts = [d.text[:3000] for d in load_corpus(max_files=8).documents]
    texts[0] = "x = '" + EOS_TOKEN + "'  # a literal separator inside a document\n" + texts[0]
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    b = build_data(
        small_cfg(
            tmp_path / "cache",
            source=str(src),
            max_bytes=None,
            tokenizer=TokenizerConfig(vocab_size=300),
            seq_length=16,
            val_fraction=0.25,
        ),
        seed=0,
    )
    assert b.info["corpus_documents"] == 8
    assert b.info["train_documents"] + b.info["val_documents"] == 8 and b.info["val_documents"] >= 1
    streams = [np.fromfile(ds.bin_path, dtype=np.uint16) for ds in (b.train, b.val)]
    # Exactly one EOS per document: the literal in texts[0] was encoded as ordinary text.
    assert sum(int((s == b.eos_id).sum()) for s in streams) == 8
    # ...and it still decodes back: 8 separators plus the literal.
    assert b.decode(np.concatenate(streams).tolist()).count(EOS_TOKEN) == 9


def test_missing_source_names_the_key(tmp_path):
    with pytest.raises(DataError, match=r"data\.source: .*does_not_exist"):
        build_data(small_cfg(tmp_path, source=str(tmp_path / "does_not_exist")), seed=0)
    other = tmp_path / "notes.csv"
    other.write_text("a,b\n")
    with pytest.raises(DataError, match=r"data\.source: .*not a \.jsonl"):
        load_corpus(str(other))


def test_split_is_by_document_and_never_empty():
    docs = load_corpus(max_files=2).documents
    train, val = split_documents(docs, 0.0001)  # threshold 1 bucket: almost surely nothing hashes there
    assert len(train) == 1 and len(val) == 1
    train, val = split_documents(docs, 0.0)
    assert len(train) == 2 and val == []
    many = load_corpus(max_bytes=SMALL).documents
    t1, v1 = split_documents(many, 0.2)
    t2, v2 = split_documents(many, 0.2)
    assert v1 == v2 and set(d.name for d in t1).isdisjoint(d.name for d in v1)
    assert len(t1) + len(v1) == len(many)


# ---------------------------------------------------------------------------- tokenizer and caches


def test_build_is_deterministic_and_second_call_is_a_cache_hit(bundle, cache_a, tmp_path):
    info = bundle.info
    assert not info["tokenizer_cache_hit"] and not info["pretokenize_cache_hit"]
    tok_path = Path(info["tokenizer_path"])
    pre_dir = Path(info["pretokenize_dir"])
    files = (tok_path, pre_dir / "train.bin", pre_dir / "val.bin", pre_dir / "meta.json")
    mtimes = {p: p.stat().st_mtime_ns for p in files}

    again = build_data(small_cfg(cache_a), seed=7)
    assert again.info["tokenizer_cache_hit"] and again.info["pretokenize_cache_hit"]
    assert again.info["tokenizer_path"] == str(tok_path) and again.info["pretokenize_dir"] == str(pre_dir)
    assert {p: p.stat().st_mtime_ns for p in mtimes} == mtimes  # nothing was rewritten

    # An independent build in another cache dir trains and encodes from scratch: same bytes.
    other = build_data(small_cfg(tmp_path), seed=7)
    assert not other.info["tokenizer_cache_hit"] and not other.info["pretokenize_cache_hit"]
    assert Path(other.info["tokenizer_path"]).read_bytes() == tok_path.read_bytes()
    other_dir = Path(other.info["pretokenize_dir"])
    for name in ("train.bin", "val.bin"):
        assert (other_dir / name).read_bytes() == (pre_dir / name).read_bytes()
    meta = json.loads((other_dir / "meta.json").read_text())
    assert meta["dtype"] == "uint16" and meta["train_tokens"] == bundle.train.n_tokens
    assert meta["tokenizer_hash"] == bundle.info["tokenizer_hash"]
    # No temporary leftovers from the atomic writes.
    assert not [p for p in tmp_path.rglob("*") if p.name.endswith(".tmp")]


def test_changed_inputs_miss_the_cache(bundle, cache_a):
    smaller = build_data(small_cfg(cache_a, max_bytes=SMALL // 2), seed=7)
    assert smaller.info["corpus_hash"] != bundle.info["corpus_hash"]
    assert smaller.info["tokenizer_path"] != bundle.info["tokenizer_path"]
    assert smaller.info["pretokenize_dir"] != bundle.info["pretokenize_dir"]
    assert not smaller.info["tokenizer_cache_hit"] and not smaller.info["pretokenize_cache_hit"]
    # Same corpus and vocab, different split: the tokenizer is reused, the token files are not.
    resplit = build_data(small_cfg(cache_a, val_fraction=0.2), seed=7)
    assert resplit.info["tokenizer_cache_hit"] and not resplit.info["pretokenize_cache_hit"]
    assert resplit.info["val_tokens"] > bundle.info["val_tokens"]


def test_tokenizer_round_trip_and_eos(bundle):
    snippet = 'def f(x):\r\n\t"""Docstring, é ü 漢字 🙂."""\n    return  x ** 2  # two spaces\n'
    ids = bundle.encode(snippet)
    assert all(0 <= i < bundle.vocab_size for i in ids)
    assert bundle.decode(ids) == snippet
    assert bundle.vocab_size == 512 == bundle.tokenizer.get_vocab_size()
    assert bundle.tokenizer.token_to_id(EOS_TOKEN) == bundle.eos_id
    assert bundle.decode(ids + [bundle.eos_id]).endswith(EOS_TOKEN)
    assert bundle.eos_id not in bundle.encode("<|endoftext" + "x")  # ordinary text never yields EOS


# ---------------------------------------------------------------------------- dataset


def test_samples_are_contiguous_windows_of_the_token_stream(bundle):
    ds = bundle.train
    L = ds.seq_length
    stream = np.fromfile(ds.bin_path, dtype=np.uint16).astype(np.int64)
    assert len(ds) == (len(stream) - 1) // L
    # One EOS after each training document.
    assert int((stream == bundle.eos_id).sum()) == bundle.info["train_documents"]
    assert stream[-1] == bundle.eos_id
    for i in (0, 1, len(ds) // 2, len(ds) - 1):
        x = ds[i]
        assert x.dtype == torch.long and x.shape == (L + 1,)
        assert torch.equal(x, torch.from_numpy(stream[i * L : i * L + L + 1]))
        inputs, targets = x[:-1], x[1:]
        assert torch.equal(targets[:-1], inputs[1:])  # targets are inputs shifted by one
    assert torch.equal(ds[0][-1], ds[1][0])  # neighbouring windows share one boundary token
    assert torch.equal(ds[-1], ds[len(ds) - 1])
    with pytest.raises(IndexError):
        ds[len(ds)]


def test_too_few_tokens_names_the_split(tmp_path):
    path = tmp_path / "val.bin"
    np.arange(10, dtype=np.uint16).tofile(path)
    with pytest.raises(DataError, match=r"val split has 10 tokens.*data\.max_bytes.*data\.seq_length"):
        PackedDataset(path, "uint16", seq_length=16, split="val")
    assert len(PackedDataset(path, "uint16", seq_length=3)) == 3


def test_val_batches_are_fixed_and_shard_by_rank(bundle):
    a = bundle.val_batches(12, 4)
    b = bundle.val_batches(12, 4)
    assert len(a) == 3 and all(x.shape == (4, 33) for x in a)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert torch.equal(a[0][0], bundle.val[0])
    assert len(bundle.val_batches(10_000, 4)) == len(bundle.val) // 4
    # Two data-parallel ranks evaluate disjoint halves of the same 12 samples.
    r0, r1 = bundle.val_batches(12, 2, 0, 2), bundle.val_batches(12, 2, 1, 2)
    got = sorted(tuple(x.tolist()) for batch in r0 + r1 for x in batch)
    assert got == sorted(tuple(x.tolist()) for batch in a for x in batch)
    with pytest.raises(DataError, match="fewer than one batch"):
        bundle.val_batches(10_000, len(bundle.val) + 1)


# ---------------------------------------------------------------------------- sampler


def take(it, n):
    return [next(it) for _ in range(n)]


def test_sampler_state_round_trip_ignores_prefetch():
    s = ResumableSampler(50, seed=3)
    it = iter(s)
    take(it, 23)  # the loader pulled 23 indices ahead...
    s.advance(17)  # ...but the trainer consumed only 17
    state = s.state_dict()
    assert state == {"seed": 3, "epoch": 0, "position": 17, "dp_rank": 0, "dp_size": 1, "num_samples": 50}
    expected = take(iter(s), 60)  # what the original yields next, across an epoch boundary

    fresh = ResumableSampler(50, seed=999)  # the saved seed wins
    fresh.load_state_dict(state)
    assert take(iter(fresh), 60) == expected
    assert expected[:33] == s.epoch_indices(0)[17:]


def test_sampler_epochs_roll_over_with_new_orders():
    s = ResumableSampler(10, seed=0)
    first = take(iter(s), 30)
    e0, e1, e2 = first[:10], first[10:20], first[20:]
    assert sorted(e0) == sorted(e1) == sorted(e2) == list(range(10))
    assert e0 != e1
    s.advance(25)
    assert (s.epoch, s.position) == (2, 5)
    assert take(iter(s), 5) == e2[5:]
    assert s.consumed_samples == 25
    with pytest.raises(DataError, match="saved for 10 training samples"):
        ResumableSampler(11, seed=0).load_state_dict(s.state_dict())


def test_sampler_dp_sharding_and_resize():
    n = 21
    r0, r1 = (ResumableSampler(n, seed=5, dp_rank=r, dp_size=2) for r in (0, 1))
    assert r0.samples_per_epoch == r1.samples_per_epoch == 10
    for epoch in (0, 1):
        a, b = r0.epoch_indices(epoch), r1.epoch_indices(epoch)
        assert set(a).isdisjoint(b) and len(set(a) | set(b)) == n // 2 * 2
    assert take(iter(r0), 20)[10:] == r0.epoch_indices(1)

    # Two ranks each consumed 4 this epoch -> one rank continues after the same 8 global samples.
    for s in (r0, r1):
        s.advance(14)  # epoch 1, position 4
    single = ResumableSampler(n, seed=5)
    single.load_state_dict(r1.state_dict())
    assert (single.epoch, single.position) == (1, 8)
    seen = set(r0.epoch_indices(1)[:4]) | set(r1.epoch_indices(1)[:4])
    rest = single.epoch_indices(1)[8:]
    assert seen.isdisjoint(rest) and len(seen) + len(rest) == n

    # 1 rank -> 3 ranks when 8 is not a multiple of 3: resume after 6, so 2 samples repeat, none is skipped.
    three = [ResumableSampler(n, seed=5, dp_rank=r, dp_size=3) for r in range(3)]
    for s in three:
        s.load_state_dict(single.state_dict())
        assert (s.epoch, s.position) == (1, 2)
    remaining = set().union(*(s.epoch_indices(1)[2:] for s in three))
    assert remaining == set(single.epoch_indices(1)[6:])


# ---------------------------------------------------------------------------- loaders


def test_dataloader_workers_give_the_same_batches(bundle):
    def first_batches(num_workers: int) -> list[torch.Tensor]:
        cfg = small_cfg(Path(bundle.cfg.cache_dir), num_workers=num_workers, persistent_workers=num_workers > 0)
        b = build_data(cfg, seed=7)
        it = iter(b.train_loader())
        return take(it, 5)

    serial, parallel = first_batches(0), first_batches(2)
    assert all(x.shape == (4, 33) for x in serial)
    assert all(torch.equal(x, y) for x, y in zip(serial, parallel))
    # The first batch is the sampler's first indices.
    s = ResumableSampler(len(bundle.train), seed=7)
    assert torch.equal(serial[0], torch.stack([bundle.train[i] for i in take(iter(s), 4)]))
