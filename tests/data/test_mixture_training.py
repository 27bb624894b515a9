"""A weighted mixture through the trainer: the tokens drawn from each source are logged and follow the weights, a
resume continues the same draws, and a resume with another mixture is refused in one line."""

from __future__ import annotations

import json

import pytest

from canntrain_core.data import DataError
from canntrain_core.recipe import load_recipe
from canntrain_core.train.metrics import read_metrics
from canntrain_core.train.trainer import Trainer
from conftest import FAST, TINY

BATCH, SEQ = 4, 32


def write(path, n: int, word: str):
    path.write_text("".join(json.dumps({"text": f"{word} {i} " * (20 + i % 30)}) + "\n" for i in range(n)))
    return str(path)


@pytest.fixture
def keys(tmp_path):
    a, b = write(tmp_path / "a.jsonl", 300, "alpha"), write(tmp_path / "b.jsonl", 120, "beta")
    sources = [{"path": a, "weight": 0.75, "name": "web"}, {"path": b, "weight": 0.25, "name": "code"}]
    return {
        **FAST,
        "data.source": None,
        "data.sources": sources,
        "data.max_bytes": None,
        "data.seq_length": SEQ,
        "data.batch_size": BATCH,
        "data.tokenizer.vocab_size": 300,
        "data.cache_dir": str(tmp_path / "cache"),
        "optim.max_steps": 6,
        "logging.ckpt_interval": 3,
        "logging.eval_interval": 6,
        "logging.eval_batches": 1,
    }


def test_a_mixture_logs_tokens_per_source_by_weight_and_resumes_the_same_draws(keys, tmp_path):
    Trainer(load_recipe(TINY, keys), run_dir=tmp_path / "full", progress=False).fit()
    rows = [r for r in read_metrics(tmp_path / "full") if "loss" in r]
    assert [r["step"] for r in rows] == list(range(1, 7))
    for r in rows:
        drawn = r["step"] * BATCH
        assert r["tokens/web"] + r["tokens/code"] == drawn * SEQ
        assert abs(r["tokens/web"] / SEQ - 0.75 * drawn) <= 1  # within one sample of the weight, at every step
    cut = tmp_path / "cut"
    Trainer(load_recipe(TINY, keys), run_dir=cut, progress=False).fit(stop_after=3)
    Trainer(load_recipe(TINY, keys), run_dir=cut, resume_from="auto", progress=False).fit()
    resumed = [r for r in read_metrics(cut) if "loss" in r]
    assert [(r["loss"], r["tokens/web"]) for r in resumed] == [(r["loss"], r["tokens/web"]) for r in rows]


def test_a_resume_with_another_mixture_is_refused(keys, tmp_path):
    Trainer(load_recipe(TINY, keys), run_dir=tmp_path / "run", progress=False).fit(stop_after=3)
    other = {**keys, "data.sources": [{**s, "weight": 0.5} for s in keys["data.sources"]]}
    with pytest.raises(DataError, match=r"mixture weights \[0\.75, 0\.25\] differ from data\.sources' \[0\.5, 0\.5\]"):
        Trainer(load_recipe(TINY, other), run_dir=tmp_path / "run", resume_from="auto", progress=False)
