"""``canntrain prepare``: every source format to the same token shards, exact round trips, workers and nodes that
change nothing, a killed preparation that resumes to identical shards, pretrained tokenizers (tokenizer.json and
SentencePiece through transformers), and the command line."""

from __future__ import annotations

import gzip
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from canntrain_core.cli import main
from canntrain_core.data import DataError, IndexedTokens, PrepareOptions, build_data, open_prepared, prepare
from canntrain_core.recipe import DataConfig, TokenizerConfig

N_DOCS = 600


def documents() -> list[str]:
    """Varied text: code-like lines, prose, unicode, blank lines, a literal special token."""
    words = "alpha beta gamma delta épsilon ζήτα 漢字 🙂 def return x_1 = 42".split()
    out = []
    for i in range(N_DOCS):
        n = 5 + (i * 37) % 120
        body = " ".join(words[(i * 7 + k * 3) % len(words)] for k in range(n))
        out.append(f"# doc {i}\n{body}\n" + ("\n\tindented <|endoftext|> literal\n" if i % 50 == 0 else ""))
    return out


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    lines = "".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(documents()))
    (root / "docs.jsonl").write_text(lines)
    return root


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory) -> Path:
    """The corpus prepared by one process, small shards: what every other way of preparing must equal."""
    out = tmp_path_factory.mktemp("ref") / "prepared"
    prepare([str(corpus / "docs.jsonl")], out, train_vocab=400, opts=PrepareOptions(unit_bytes=16 << 10))
    return out


def shard_bytes(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((out / "shards").glob("*")) if p.suffix in (".bin", ".idx")}


def decoded_documents(out: Path) -> list[str]:
    data = open_prepared(out)
    from canntrain_core.data import load_tokenizer_dir

    tok = load_tokenizer_dir(data.tokenizer_dir)
    docs = []
    for s in data.shards:
        for d in range(s.n_documents):
            ids = s.document(d).tolist()
            assert ids[-1] == tok.eos_id  # each document ends with the tokenizer's EOS
            docs.append(tok.tokenizer.decode(ids[:-1], skip_special_tokens=False))
    return docs


def test_text_to_shards_to_text_is_exact(reference):
    manifest = json.loads((reference / "manifest.json").read_text())
    assert manifest["documents"] == N_DOCS and len(manifest["shards"]) > 4
    assert decoded_documents(reference) == documents()
    data = open_prepared(reference)
    assert data.fingerprint == manifest["fingerprint"] and data.n_tokens == manifest["tokens"]
    assert all(s.dtype == np.uint16 for s in data.shards)


def test_every_format_prepares_to_the_same_tokens(corpus, reference, tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    lines = (corpus / "docs.jsonl").read_bytes()
    (tmp_path / "docs.jsonl.gz").write_bytes(gzip.compress(lines))
    (tmp_path / "docs.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines))
    table = pa.table({"id": list(range(N_DOCS)), "text": documents()})
    pq.write_table(table, tmp_path / "docs.parquet", row_group_size=64)  # several row groups: several units
    datasets.Dataset.from_dict({"text": documents()}).save_to_disk(str(tmp_path / "arrow"))
    parts = tmp_path / "parts"
    parts.mkdir()
    docs = lines.splitlines(keepends=True)
    for k in range(3):  # a glob of shards, as corpora ship
        (parts / f"part-{k}.jsonl").write_bytes(b"".join(docs[k * 200 : (k + 1) * 200]))
    tok = reference / "tokenizer"
    expected = np.concatenate([np.asarray(s.tokens) for s in open_prepared(reference).shards])
    for name in ("docs.jsonl.gz", "docs.jsonl.zst", "docs.parquet", "arrow", "parts/part-*.jsonl"):
        out = tmp_path / ("out-" + name.replace("/", "_").replace("*", "x"))
        prepare([str(tmp_path / name)], out, tokenizer=tok, opts=PrepareOptions(unit_bytes=16 << 10), progress=False)
        got = np.concatenate([np.asarray(s.tokens) for s in open_prepared(out).shards])
        assert np.array_equal(got, expected), name
        assert json.loads((out / "manifest.json").read_text())["documents"] == N_DOCS


def test_workers_and_nodes_change_nothing(corpus, reference, tmp_path):
    tok = reference / "tokenizer"
    src = [str(corpus / "docs.jsonl")]
    opts = PrepareOptions(unit_bytes=16 << 10)
    two = prepare(src, tmp_path / "two", tokenizer=tok, workers=2, opts=opts, progress=False)
    assert two.manifest["workers_last_run"] == 2
    # Two nodes on one shared directory: node 1 finishes first and leaves the manifest to node 0.
    first = prepare(src, tmp_path / "nodes", tokenizer=tok, node_rank=1, num_nodes=2, opts=opts, progress=False)
    assert first.manifest is None and not (tmp_path / "nodes" / "manifest.json").exists()
    last = prepare(src, tmp_path / "nodes", tokenizer=tok, node_rank=0, num_nodes=2, opts=opts, progress=False)
    ref = json.loads((reference / "manifest.json").read_text())
    for result in (two, last):
        assert shard_bytes(result.out) == shard_bytes(reference)
        assert result.manifest["fingerprint"] == ref["fingerprint"]
    again = prepare(src, tmp_path / "two", tokenizer=tok, opts=opts, progress=False)
    assert again.cache_hit and again.units_done_here == 0
    with pytest.raises(DataError, match=r"holds the preparation of other inputs, settings or tokenizer"):
        prepare(src, tmp_path / "two", tokenizer=tok, opts=PrepareOptions(unit_bytes=32 << 10), progress=False)


@pytest.mark.slow  # a subprocess killed mid-run
def test_a_killed_prepare_resumes_to_identical_shards(tmp_path):
    src = tmp_path / "big.jsonl"  # about 1 MB in 32 KB units: seconds of work, so the kill lands mid-run
    src.write_text("".join(json.dumps({"text": t * 3}) + "\n" for t in documents() * 2))
    out = tmp_path / "killed"
    args = ["prepare", str(src), "--train-tokenizer", "400", "--shard-size", "32K", "--workers", "1", "-o", str(out)]
    proc = subprocess.Popen([sys.executable, "-m", "canntrain_core.cli", *args, "--no-progress"])
    deadline = time.time() + 120
    while not (out / "shards" / "00001.json").exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert (out / "shards" / "00001.json").exists() and not (out / "manifest.json").exists()
    assert main([*args, "--no-progress"]) == 0  # the same command again: it resumes
    fresh = prepare(
        [str(src)], tmp_path / "fresh", train_vocab=400, workers=2, opts=PrepareOptions(unit_bytes=32 << 10)
    )
    assert shard_bytes(out) == shard_bytes(fresh.out)
    assert json.loads((out / "manifest.json").read_text())["fingerprint"] == fresh.manifest["fingerprint"]
    assert not list((out / "shards").glob(".*"))  # the half-written unit's files are gone


def test_sentencepiece_tokenizer_through_transformers_gives_autotokenizer_ids(tmp_path):
    import sentencepiece as spm
    from transformers import AutoTokenizer

    text = tmp_path / "sp.txt"
    text.write_text("\n".join(documents()[:300]))
    spm.SentencePieceTrainer.train(
        input=str(text), model_prefix=str(tmp_path / "sp"), vocab_size=300, model_type="bpe", minloglevel=2
    )
    tok_dir = tmp_path / "llama_tokenizer"
    tok_dir.mkdir()
    (tok_dir / "tokenizer.model").write_bytes((tmp_path / "sp.model").read_bytes())
    config = {"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(config))
    src = tmp_path / "docs.jsonl"
    docs = [d.replace("<|endoftext|>", "") for d in documents()[:40]]
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    out = tmp_path / "prepared"
    result = prepare([str(src)], out, tokenizer=tok_dir, progress=False)
    hf = AutoTokenizer.from_pretrained(str(tok_dir))
    data = open_prepared(out)
    got = [data.shards[0].document(d).tolist() for d in range(len(docs))]
    assert got == [hf(t)["input_ids"] + [hf.eos_token_id] for t in docs]  # Llama's BOS first, EOS last
    assert result.manifest["tokenizer"]["eos_id"] == hf.eos_token_id
    # Training takes the prepared dataset's tokenizer and its vocabulary.
    b = build_data(DataConfig(source=str(out), seq_length=16, val_fraction=0.1, cache_dir=str(tmp_path / "c")), seed=0)
    assert b.info["tokenizer_source"] == "prepared" and b.vocab_size == len(hf)


def test_prepared_data_trains_whole_and_names_what_does_not_fit(reference, tmp_path):
    cfg = DataConfig(source=str(reference), seq_length=32, val_fraction=0.1, cache_dir=str(tmp_path))
    b = build_data(cfg, seed=0)
    assert b.info["tokenizer_source"] == "prepared" and b.vocab_size == b.tokenizer.get_vocab_size() <= 400
    assert b.info["train_tokens"] + b.info["val_tokens"] == open_prepared(reference).n_tokens
    with pytest.raises(DataError, match=r"data\.max_bytes / data\.max_files cut a raw corpus; .* is prepared"):
        build_data(cfg.model_copy(update={"max_bytes": 1000}), seed=0)
    other = tmp_path / "other_tok"
    other.mkdir()
    from canntrain_core.data import train_tokenizer

    (other / "tokenizer.json").write_text(train_tokenizer(documents()[:50], 300).to_str())
    with pytest.raises(DataError, match=r"was prepared with another tokenizer than .*other_tok"):
        build_data(cfg.model_copy(update={"tokenizer": TokenizerConfig(path=str(other))}), seed=0)


def test_prepare_command_line(corpus, tmp_path, capsys):
    out = tmp_path / "cli"
    rc = main(["prepare", str(corpus / "docs.jsonl"), "--train-tokenizer", "300", "-o", str(out), "--no-progress"])
    assert rc == 0
    said = capsys.readouterr().out
    assert f"{N_DOCS:,} documents" in said and f"--set data.source={out}" in said
    shard = IndexedTokens(out / "shards" / "00000")
    assert shard.n_documents == N_DOCS  # one unit: a 170 KB corpus is under the smallest default shard
