"""Shared fixtures: a tiny recipe that trains in seconds, with a per-session data cache."""

from pathlib import Path

import pytest

from canntrain_core.recipe import load_recipe

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "cookbook" / "llama" / "configs" / "tiny_pretrain.yaml"

# Small enough that a step takes milliseconds, big enough that the loss visibly falls.
FAST = {
    "data.max_bytes": 300_000,
    "data.tokenizer.vocab_size": 512,
    "data.seq_length": 64,
    "data.batch_size": 4,
    "optim.max_steps": 12,
    "optim.warmup_steps": 2,
    "logging.log_interval": 1,
    "logging.eval_interval": 6,
    "logging.eval_batches": 2,
    "logging.ckpt_interval": 6,
}


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("data-cache"))


@pytest.fixture
def fast_recipe(data_cache):
    """Build the tiny recipe with FAST settings plus any extra overrides."""

    def make(**extra):
        return load_recipe(TINY, {**FAST, "data.cache_dir": data_cache, **extra})

    return make
