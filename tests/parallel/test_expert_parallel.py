"""Expert parallelism (tiny-moe on gloo): the exchange returns every token to its place, EP's experts compute what
transformers' do, and training under EP2 (2 ranks) and EP2 x FSDP2 (4 ranks) logs the losses of the same
data-parallel layout without EP; a checkpoint written under EP2 resumes bit for bit under EP2 and reshards to EP1.

transformers' logits, the seeded init and SGD under EP2 x FSDP2 for every MoE family: tests/models/test_hf.py.
"""

import subprocess
import sys

import pytest

from canntrain_core.jobs.layouts import launch_layouts
from canntrain_core.train.metrics import read_metrics
from conftest import FAST, ROOT, TINY

# EP changes only where each (token, k) pair's expert runs and the order of the k-sum: measured 1e-6 here
LOSS_TOL = 2e-4
FSDP = {"distributed.zero_optimization": 3}
EP2 = {"distributed.expert_parallel_size": 2}
TWO = {**FSDP, "distributed.data_parallel_size": 2, "data.batch_size": 4}
FOUR = {**FSDP, "distributed.data_parallel_size": 4, "data.batch_size": 2}


def losses(run_dir):
    return {r["step"]: r["loss"] for r in read_metrics(run_dir) if "loss" in r}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_cache):
    out = tmp_path_factory.mktemp("ep")
    base = {
        **FAST,
        "model.preset": "tiny-moe",
        "data.cache_dir": data_cache,
        "data.batch_size": 8,
        "optim.max_steps": 6,
        "logging.eval_interval": 3,
        "logging.ckpt_interval": 3,
    }
    launch_layouts(TINY, out, 2, base, {"fsdp2": TWO, "ep2": {**TWO, **EP2}})
    step3 = out / "ep2_fsdp2" / "checkpoints" / "step_3"
    launch_layouts(
        TINY,
        out,
        4,
        base,
        {
            "fsdp4": FOUR,
            "ep2_fsdp2": {**FOUR, **EP2},
            f"ep2_fsdp2_resumed<{step3}": {**FOUR, **EP2},
            f"fsdp4_from_ep2<{step3}": FOUR,
        },
    )
    return out


@pytest.mark.slow
def test_dispatch_and_combine_return_every_token_and_the_experts_compute_transformers_output(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
        + [str(ROOT / "tests" / "_ep_ranks.py"), str(tmp_path)],
        check=True,
        capture_output=True,
    )
    import torch

    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert all(r["roundtrip"] for r in ranks)  # exact
    assert ranks[1]["counts"][1] == 0  # expert 3 received no token, and nothing broke
    assert sum(sum(r["counts"]) for r in ranks) == 2 * (5 + 9)  # every (token, k) pair went somewhere once
    for r in ranks:  # fp64
        assert r["output_diff"] < 1e-12 and r["input_grad_diff"] < 1e-12 and r["expert_grad_diff"] < 1e-12, r


@pytest.mark.parametrize("ep, ref", [("ep2", "fsdp2"), ("ep2_fsdp2", "fsdp4")])
def test_expert_parallel_logs_the_losses_of_the_same_layout_without_it(runs, ep, ref):
    got, want = losses(runs / ep), losses(runs / ref)
    assert sorted(got) == sorted(want) == list(range(1, 7))
    assert max(abs(got[s] - want[s]) for s in want) < LOSS_TOL
    aux = [r["aux_loss"] for r in read_metrics(runs / ep) if "loss" in r]
    assert aux == pytest.approx([r["aux_loss"] for r in read_metrics(runs / ref) if "loss" in r], abs=LOSS_TOL)


def test_an_ep2_checkpoint_resumes_bit_for_bit_and_reshards_to_ep1(runs):
    full = losses(runs / "ep2_fsdp2")
    resumed = losses(runs / "ep2_fsdp2_resumed")
    assert sorted(resumed) == [4, 5, 6]
    assert all(resumed[s] == full[s] for s in resumed)  # bit for bit
    resharded = losses(runs / "fsdp4_from_ep2")
    assert max(abs(resharded[s] - full[s]) for s in resharded) < LOSS_TOL
