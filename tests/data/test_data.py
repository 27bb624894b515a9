"""Data pipeline: a real corpus (a small stdlib subset), a real tokenizer, prepared in process through the same
code as ``canntrain prepare``, real memmaps and DataLoaders."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from canntrain_core.data import DataError, EOS_TOKEN, build_data, open_prepared
from canntrain_core.data.corpus import BadRecords, list_inputs, make_units, read_unit, select
from canntrain_core.recipe import DataConfig, TokenizerConfig

SMALL = 200_000  # bytes of stdlib: tokenizer + preparation well under a second each


def small_cfg(cache_dir: Path, **kw) -> DataConfig:
    base = dict(
        source="stdlib",
        max_bytes=SMALL,
        tokenizer=TokenizerConfig(vocab_size=512),
        seq_length=32,
        batch_size=4,
        val_fraction=0.1,
        cache_dir=str(cache_dir),
    )
    base.update(kw)
    return DataConfig(**base)


def texts_of(source: str, text_field="text", policy="error", **caps) -> list[str]:
    inputs = select(list_inputs(source), caps.get("max_bytes"), caps.get("max_files"))
    bad = BadRecords(policy)
    out = [t for u in make_units(inputs, 1 << 30) for t in read_unit(inputs, u, text_field, bad)]
    return out, bad


@pytest.fixture(scope="module")
def cache_a(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache_a")


@pytest.fixture(scope="module")
def bundle(cache_a):
    return build_data(small_cfg(cache_a), seed=7)


# ---------------------------------------------------------------------------- sources


def test_stdlib_cap_is_deterministic_spread_and_within_budget():
    a = select(list_inputs("stdlib"), SMALL, None)
    assert [i.name for i in a] == [i.name for i in select(list_inputs("stdlib"), SMALL, None)]
    assert 0.8 * SMALL < sum(i.size for i in a) <= SMALL
    names = [i.name for i in a]
    assert names == sorted(names)
    assert all(n.endswith(".py") and "site-packages" not in n for n in names)
    # Spread out, not the alphabetically first files of the stdlib.
    assert names != sorted(i.name for i in list_inputs("stdlib"))[: len(names)]
    assert len(select(list_inputs("stdlib"), None, 3)) == 3


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
    texts, bad = texts_of(str(root), policy="skip")
    assert texts == ["# first\n", "second file\n", "print('hi')\n"]
    assert bad.examples == [
        "image.bin: a binary file (NUL byte at byte 4), not text",
        "latin1.txt: not UTF-8 (unexpected end of data, byte 0xe9 at byte 3)",
    ]


def test_a_directory_lists_files_through_links_but_not_linked_folders(tmp_path):
    """The listing's rules, one case each: hidden names, __pycache__ and site-packages are left out, and so are empty
    files, a dangling link and a link to a folder (os.walk's default); a link to a file is that file."""
    root = tmp_path / "texts"
    (root / "sub" / "deeper").mkdir(parents=True)
    for folder in (".hidden", "__pycache__", "site-packages"):
        (root / folder).mkdir()
        (root / folder / "x.txt").write_text("left out\n")
    (root / "sub" / "deeper" / "b.txt").write_text("b\n")
    (root / "sub.txt").write_text("sorted by path, not by walk\n")
    (root / ".dot.txt").write_text("hidden\n")
    (root / "empty.txt").write_text("")
    (root / "records.jsonl").write_text('{"text": "r"}\n')
    (root / "link.txt").symlink_to(root / "sub" / "deeper" / "b.txt")
    (root / "linked_folder").symlink_to(root / "sub")
    (root / "dangling.txt").symlink_to(root / "missing.txt")
    listed = list_inputs(str(root))
    assert [(i.name, i.kind) for i in listed] == [
        ("link.txt", "text"),
        ("records.jsonl", "jsonl"),
        ("sub.txt", "text"),
        ("sub/deeper/b.txt", "text"),
    ]
    assert listed[0].path == str(root / "link.txt") and listed[0].size == 2


def test_jsonl_source_and_errors(tmp_path):
    good = tmp_path / "good.jsonl"
    good.write_text('{"body": "one"}\n\n{"body": "two", "x": 1}\n')
    assert texts_of(str(good), "body")[0] == ["one", "two"]

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"text": "broken"\n')
    with pytest.raises(DataError, match=r"bad\.jsonl, line 2: invalid JSON"):
        texts_of(str(bad))

    nokey = tmp_path / "nokey.jsonl"
    nokey.write_text('{"text": "ok"}\n{"text": "ok"}\n{"content": "x"}\n')
    with pytest.raises(DataError, match=r"nokey\.jsonl, line 3: record has no key 'text'"):
        texts_of(str(nokey))


def test_a_large_jsonl_is_read_in_byte_ranges_that_lose_and_repeat_no_line(tmp_path):
    src = tmp_path / "big.jsonl"
    lines = [json.dumps({"text": f"document {i} " + "x" * (i % 37)}) + "\n" for i in range(500)]
    src.write_text("".join(lines))
    inputs = list_inputs(str(src))
    units = make_units(inputs, 1000)  # about 20 ranges, each starting mid-line
    assert len(units) > 10 and all(u.inputs == (0,) for u in units)
    bad = BadRecords("error")
    got = [t for u in units for t in read_unit(inputs, u, "text", bad)]
    assert got == [json.loads(line)["text"] for line in lines]
    # A bad record in a later range is still named by its line.
    lines[400] = '{"text": 1}\n'
    src.write_text("".join(lines))
    inputs = list_inputs(str(src))
    with pytest.raises(DataError, match=r"big\.jsonl, line 401: 'text' must be a string, got a number"):
        [t for u in make_units(inputs, 1000) for t in read_unit(inputs, u, "text", bad)]


def test_bad_files_in_a_text_directory(tmp_path):
    root = tmp_path / "texts"
    root.mkdir()
    (root / "good.txt").write_text("plain text\n")
    (root / "latin1.txt").write_bytes("na\xefve caf\xe9\n".encode("latin-1"))
    with pytest.raises(
        DataError, match=r"texts/latin1\.txt: not UTF-8 \(invalid continuation byte, byte 0xef at byte 2\)"
    ):
        texts_of(str(root))
    texts, bad = texts_of(str(root), policy="skip")
    assert texts == ["plain text\n"]
    assert bad.examples == ["latin1.txt: not UTF-8 (invalid continuation byte, byte 0xef at byte 2)"]
    # Nothing usable left: one clear error before a tokenizer would train on nothing.
    (root / "good.txt").unlink()
    with pytest.raises(DataError, match=r"no usable documents in .*texts: skipped 1 bad record\(s\): latin1\.txt"):
        build_data(small_cfg(tmp_path / "c", source=str(root), max_bytes=None, on_bad_record="skip"), seed=0)


def test_stdlib_non_utf8_test_files_are_skipped_and_counted_whatever_the_policy(tmp_path, monkeypatch):
    # A stand-in stdlib (some installs ship it without test/, where the real latin-1 files live).
    (tmp_path / "lib" / "test").mkdir(parents=True)
    (tmp_path / "lib" / "abc.py").write_text("x = 1\n" * 50)
    (tmp_path / "lib" / "test" / "latin1.py").write_bytes(b"# -*- coding: latin-1 -*-\ns = 'caf\xe9'\n")
    monkeypatch.setattr("canntrain_core.data.corpus.stdlib_dir", lambda: tmp_path / "lib")
    b = build_data(
        small_cfg(tmp_path / "c", on_bad_record="error", seq_length=4, val_fraction=0.0, max_bytes=None), seed=0
    )
    assert b.info["documents"] == 1 and b.info["bad_records"] == 1
    assert b.info["bad_record_examples"] == [
        "test/latin1.py: not UTF-8 (invalid continuation byte, byte 0xe9 at byte 34)"
    ]


def test_missing_source_names_the_key(tmp_path):
    with pytest.raises(DataError, match=r"data\.source: .*does_not_exist.* does not exist"):
        build_data(small_cfg(tmp_path, source=str(tmp_path / "does_not_exist")), seed=0)
    other = tmp_path / "notes.csv"
    other.write_text("a,b\n")
    with pytest.raises(DataError, match=r"is a file, but not a record file"):
        list_inputs(str(other))
    with pytest.raises(DataError, match=r"data\.source: not set"):
        build_data(small_cfg(tmp_path, source=None), seed=0)


# ---------------------------------------------------------------------------- tokenizer and caches


def test_build_is_deterministic_and_second_call_lists_and_opens(bundle, cache_a, tmp_path):
    info = bundle.info
    assert not info["tokenizer_cache_hit"] and not info["prepare_cache_hit"]
    tok_path = Path(info["tokenizer_path"])
    prepared = Path(info["sources"][0]["prepared"])
    files = [tok_path, prepared / "manifest.json", *sorted((prepared / "shards").iterdir())]
    mtimes = {p: p.stat().st_mtime_ns for p in files}

    again = build_data(small_cfg(cache_a), seed=7)
    assert again.info["tokenizer_cache_hit"] and again.info["prepare_cache_hit"]
    assert again.info["tokenizer_path"] == str(tok_path) and again.info["sources"][0]["prepared"] == str(prepared)
    assert {p: p.stat().st_mtime_ns for p in mtimes} == mtimes  # nothing was rewritten

    # An independent build in another cache dir trains and encodes from scratch: same bytes.
    other = build_data(small_cfg(tmp_path), seed=7)
    assert not other.info["tokenizer_cache_hit"] and not other.info["prepare_cache_hit"]
    assert Path(other.info["tokenizer_path"]).read_bytes() == tok_path.read_bytes()
    other_dir = Path(other.info["sources"][0]["prepared"])
    for p in sorted((prepared / "shards").iterdir()):
        assert (other_dir / "shards" / p.name).read_bytes() == p.read_bytes()
    manifest = json.loads((other_dir / "manifest.json").read_text())
    assert manifest["dtype"] == "uint16" and manifest["tokens"] == info["train_tokens"] + info["val_tokens"]
    assert manifest["tokenizer"]["sha256"] == bundle.info["tokenizer_hash"]
    assert not [p for p in tmp_path.rglob("*") if p.name.endswith(".tmp")]  # no leftovers of atomic writes


def test_changed_inputs_miss_the_cache(bundle, cache_a, tmp_path):
    smaller = build_data(small_cfg(cache_a, max_bytes=SMALL // 2), seed=7)
    assert smaller.info["tokenizer_path"] != bundle.info["tokenizer_path"]
    assert smaller.info["sources"][0]["prepared"] != bundle.info["sources"][0]["prepared"]
    assert not smaller.info["tokenizer_cache_hit"] and not smaller.info["prepare_cache_hit"]
    # Same corpus and vocab, another split: the tokenizer and the prepared tokens are reused, the split is new.
    resplit = build_data(small_cfg(cache_a, val_fraction=0.3), seed=7)
    assert resplit.info["tokenizer_cache_hit"] and resplit.info["prepare_cache_hit"]
    assert resplit.info["val_tokens"] > bundle.info["val_tokens"]
    assert resplit.info["train_tokens"] + resplit.info["val_tokens"] == (
        bundle.info["train_tokens"] + bundle.info["val_tokens"]
    )
    # An edited file (its size or modification time) is a new listing: prepared again.
    src = tmp_path / "docs"
    src.mkdir()
    (src / "a.txt").write_text("alpha beta gamma\n" * 40)
    (src / "b.txt").write_text("delta epsilon\n" * 40)
    cfg = small_cfg(tmp_path / "c", source=str(src), max_bytes=None, tokenizer=TokenizerConfig(vocab_size=300))
    first = build_data(cfg, seed=0)
    (src / "a.txt").write_text("alpha beta gamma!\n" * 40)
    edited = build_data(cfg, seed=0)
    assert not edited.info["prepare_cache_hit"]
    assert edited.info["sources"][0]["fingerprint"] != first.info["sources"][0]["fingerprint"]


def test_tokenizer_round_trip_and_eos(bundle):
    snippet = 'def f(x):\r\n\t"""Docstring, é ü 漢字 🙂."""\n    return  x ** 2  # two spaces\n'
    ids = bundle.encode(snippet)
    assert all(0 <= i < bundle.vocab_size for i in ids)
    assert bundle.decode(ids) == snippet
    assert bundle.vocab_size == 512 == bundle.tokenizer.get_vocab_size()
    assert bundle.tokenizer.token_to_id(EOS_TOKEN) == bundle.eos_id
    assert bundle.decode(ids + [bundle.eos_id]).endswith(EOS_TOKEN)
    assert bundle.eos_id not in bundle.encode("<|endoftext" + "x")  # ordinary text never yields EOS


def test_a_pretrained_tokenizer_path_sets_the_vocabulary(tmp_path, bundle):
    from canntrain_core.data.pipeline import model_vocab_size

    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    (tok_dir / "tokenizer.json").write_text(bundle.tokenizer.to_str())
    cfg = small_cfg(tmp_path / "c", tokenizer=TokenizerConfig(path=str(tok_dir)))
    b = build_data(cfg, seed=0)
    assert b.info["tokenizer_source"] == "path" and b.vocab_size == 512 == model_vocab_size(cfg)
    assert b.info["tokenizer_hash"] == bundle.info["tokenizer_hash"]
    more = small_cfg(tmp_path / "c", tokenizer=TokenizerConfig(path=str(tok_dir), vocab_size=640))
    assert build_data(more, seed=0).vocab_size == 640 == model_vocab_size(more)  # padded rows, as Megatron's
    fewer = small_cfg(tmp_path / "c", tokenizer=TokenizerConfig(path=str(tok_dir), vocab_size=300))
    with pytest.raises(DataError, match=r"vocab_size=300 is smaller than the tokenizer's 512 tokens"):
        build_data(fewer, seed=0)
    missing = small_cfg(tmp_path / "c", tokenizer=TokenizerConfig(path=str(tmp_path / "nope")))
    with pytest.raises(DataError, match=r"data\.tokenizer\.path: .*nope does not exist.*canntrain prepare SOURCE"):
        build_data(missing, seed=0)


# ---------------------------------------------------------------------------- samples


def test_samples_are_contiguous_windows_of_the_split_stream(bundle, tmp_path):
    ds = bundle.train.datasets[0]
    L = ds.seq_length
    stream = ds.stream.read(0, ds.n_tokens)
    assert len(ds) == (len(stream) - 1) // L
    data = open_prepared(bundle.info["sources"][0]["prepared"])
    every = np.concatenate([np.asarray(s.tokens) for s in data.shards]).astype(np.int64)
    assert int((every == bundle.eos_id).sum()) == data.n_documents  # one EOS after each document
    # train + val hold every document once: the train stream is the whole stream with val's documents cut out
    val = bundle.val.datasets[0].stream.read(0, bundle.val.datasets[0].n_tokens)
    assert len(stream) + len(val) == len(every)
    assert sorted(np.concatenate([stream, val]).tolist()) == sorted(every.tolist())
    for i in (0, 1, len(ds) // 2, len(ds) - 1):
        x = ds[i]
        assert x.dtype == torch.long and x.shape == (L + 1,)
        assert torch.equal(x, torch.from_numpy(stream[i * L : i * L + L + 1]))
    assert torch.equal(ds[0][-1], ds[1][0])  # neighbouring windows share one boundary token
    assert torch.equal(ds[-1], ds[len(ds) - 1])
    with pytest.raises(IndexError):
        ds[len(ds)]


def test_too_few_tokens_names_the_split(tmp_path):
    src = tmp_path / "tiny.jsonl"
    src.write_text('{"text": "a b"}\n{"text": "c d e f g h i j k l m n o p"}\n')
    cfg = small_cfg(tmp_path / "c", source=str(src), max_bytes=None, tokenizer=TokenizerConfig(vocab_size=260))
    with pytest.raises(DataError, match=r"tiny\.jsonl: the (val|train) split has \d+ tokens.*data\.seq_length"):
        build_data(cfg.model_copy(update={"seq_length": 64}), seed=0)


def test_val_batches_are_fixed_and_shard_by_rank(bundle):
    a = bundle.val_batches(12, 4)
    b = bundle.val_batches(12, 4)
    assert len(a) == 3 and all(x.shape == (4, 33) for x in a)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert len(bundle.val_batches(10_000, 4)) == len(bundle.val) // 4
    # Two data-parallel ranks evaluate disjoint halves of the same 12 samples.
    r0, r1 = bundle.val_batches(12, 2, 0, 2), bundle.val_batches(12, 2, 1, 2)
    got = sorted(tuple(x.tolist()) for batch in r0 + r1 for x in batch)
    assert got == sorted(tuple(x.tolist()) for batch in a for x in batch)
    with pytest.raises(DataError, match="fewer than one batch"):
        bundle.val_batches(10_000, len(bundle.val) + 1)


def test_dataloader_workers_give_the_same_batches(bundle):
    def first_batches(num_workers: int) -> list[torch.Tensor]:
        cfg = small_cfg(Path(bundle.cfg.cache_dir), num_workers=num_workers, persistent_workers=num_workers > 0)
        it = iter(build_data(cfg, seed=7).train_loader())
        return [next(it) for _ in range(5)]

    serial, parallel = first_batches(0), first_batches(2)
    assert all(x.shape == (4, 33) for x in serial)
    assert all(torch.equal(x, y) for x, y in zip(serial, parallel))
    first = bundle.sampler.indices(np.arange(4))  # the first batch is the sampler's first draws
    assert torch.equal(serial[0], torch.stack([bundle.train[int(i)] for i in first]))


def test_literal_eos_in_a_document_stays_text(tmp_path):
    texts, _ = texts_of("stdlib", max_files=8)
    texts = [t[:3000] for t in texts]
    texts[0] = "x = '" + EOS_TOKEN + "'  # a literal separator inside a document\n" + texts[0]
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    cfg = small_cfg(tmp_path / "c", source=str(src), max_bytes=None, tokenizer=TokenizerConfig(vocab_size=300))
    b = build_data(cfg.model_copy(update={"seq_length": 16, "val_fraction": 0.25}), seed=0)
    data = open_prepared(b.info["sources"][0]["prepared"])
    stream = np.concatenate([np.asarray(s.tokens) for s in data.shards])
    assert data.n_documents == 8
    assert int((stream == b.eos_id).sum()) == 8  # exactly one EOS per document: the literal stayed text
    assert b.decode(stream.tolist()).count(EOS_TOKEN) == 9  # ...and decodes back: 8 separators plus the literal
