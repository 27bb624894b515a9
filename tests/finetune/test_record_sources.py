"""Instruction and preference data in the formats corpora ship in (.jsonl.gz, .jsonl.zst, Parquet, a datasets
directory), read into the same conversations, and a weighted mixture of instruction sets through the stages'
sampler."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pytest

from canntrain_core.data import DataError
from canntrain_core.finetune.data import build_sft_data
from canntrain_core.finetune.records import read_conversations
from canntrain_core.finetune.tasks import task_records
from canntrain_core.recipe import DataConfig, SourceWeight, TemplateConfig, TokenizerConfig


def sft_cfg(tmp_path, **kw) -> DataConfig:
    base = dict(
        seq_length=32,
        batch_size=8,
        val_fraction=0.05,
        packing=True,
        template=TemplateConfig(user="{content} =", assistant=" {content}{eos}"),
        tokenizer=TokenizerConfig(vocab_size=300),
        cache_dir=str(tmp_path / "cache"),
    )
    return DataConfig(**{**base, **kw})


def test_every_record_format_reads_the_same_conversations(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    records = task_records(50, seed=1)
    lines = "".join(json.dumps(r) + "\n" for r in records).encode()
    (tmp_path / "t.jsonl").write_bytes(lines)
    (tmp_path / "t.jsonl.gz").write_bytes(gzip.compress(lines))
    (tmp_path / "t.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines))
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "t.parquet", row_group_size=16)
    datasets.Dataset.from_list(records).save_to_disk(str(tmp_path / "arrow"))
    expected = [c.turns for c in read_conversations(tmp_path / "t.jsonl")[0]]
    for name in ("t.jsonl.gz", "t.jsonl.zst", "t.parquet", "arrow"):
        got, bad = read_conversations(tmp_path / name)
        assert [c.turns for c in got] == expected and bad == [], name
    # a bad row is named by file and row
    records[7] = {"instruction": "no output here"}
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "bad.parquet")
    with pytest.raises(DataError, match=r"bad\.parquet, row 7: alpaca record needs a string 'output'"):
        read_conversations(tmp_path / "bad.parquet")


def test_a_mixture_of_instruction_sets_draws_by_weight(tmp_path):
    sort = tmp_path / "sort.jsonl.gz"
    sort.write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in task_records(400, kinds=("sort",))).encode()))
    upper = tmp_path / "upper.jsonl"
    upper.write_text("".join(json.dumps(r) + "\n" for r in task_records(400, seed=3, kinds=("upper",))))
    sources = [SourceWeight(path=str(sort), weight=0.8), SourceWeight(path=str(upper), weight=0.2, name="up")]
    b = build_sft_data(sft_cfg(tmp_path, sources=sources), seed=0)
    assert b.names == ["sort.jsonl.gz", "up"]
    sizes = b.sampler.sizes
    assert len(b.train) == sum(sizes) and b.info["records"] == 800
    drawn = b.sampler.indices(np.arange(1000))
    assert abs(float((drawn < sizes[0]).mean()) - 0.8) <= 0.001  # rows of the first set: 80 % of the draws
