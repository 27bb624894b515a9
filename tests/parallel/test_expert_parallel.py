"""Expert parallelism's exchange on 2 gloo ranks: every token returns to its place (a capacity's dropped pairs as
zeros), and EP's experts compute what transformers' do.

Training under EP2, EP2 x FSDP2 and EP2 x TP2 (+SP), and resuming and resharding an EP2 checkpoint:
tests/parallel/test_distributed.py (in its launches). transformers' logits, the seeded init and SGD under EP2 x
FSDP2 for every MoE family: tests/models/test_hf.py.
"""

import pytest
import torch

import _ep_ranks
from canntrain_core.jobs.local_ranks import run_local_ranks


@pytest.mark.slow
def test_dispatch_and_combine_return_every_token_and_the_experts_compute_transformers_output(tmp_path):
    run_local_ranks(_ep_ranks.main, (str(tmp_path),), 2, tmp_path / "logs")
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert all(r["roundtrip"] for r in ranks)  # exact
    assert ranks[1]["counts"][1] == 0  # expert 3 received no token, and nothing broke
    assert sum(sum(r["counts"]) for r in ranks) == 2 * (5 + 9)  # every (token, k) pair went somewhere once
    for r in ranks:  # fp64
        assert r["output_diff"] < 1e-12 and r["input_grad_diff"] < 1e-12 and r["expert_grad_diff"] < 1e-12, r
    # a capacity of 2 pairs per expert: the dropped pairs come back as zeros, the kept ones exactly
    assert all(r["dropped_roundtrip"] for r in ranks)
    assert all(r["kept"] < 2 * (5 + 4 * i) for i, r in enumerate(ranks))  # something was dropped on each rank
    assert sum(sum(r["kept_counts"]) for r in ranks) == sum(r["kept"] for r in ranks)
    assert all(r["dropped_output_diff"] < 1e-12 for r in ranks)
