"""Parallel layouts compute what the single process computes (gloo, several local processes).

Each layout trains the tiny model for 4 steps on global batches of 8 sequences and must log the
same losses as one process, step by step, within LOSS_TOL. Measured here in fp32: the largest
difference over all layouts is about 1e-6 (reductions summed in another order).
A checkpoint written by 4 ranks resumes on 2 ranks and on 1, and one written by 1 rank resumes on 2, continuing the
same curve (the data position is the job's global count of samples drawn).

The mixture of experts (tiny-moe) trains in the same launches: expert parallelism EP2 on 2 ranks, EP2 x FSDP2 and
EP2 x TP2 (+SP) on 4 log the losses of the same data-parallel layout without EP (EP changes only where each
(token, k) pair's expert runs and the order of the k-sum: measured 1e-6); a checkpoint written under EP2 resumes
bit for bit under EP2 and reshards to EP1.
"""

import json
from pathlib import Path

import pytest
import torch

from canntrain_core.jobs.layouts import launch_layouts, run_layouts
from canntrain_core.train.metrics import read_metrics
from conftest import FAST, TINY

LOSS_TOL = 2e-4

# Every layout trains on global batches of 8 sequences, like the single-process reference. Features that do not
# interact share a run (each run costs a few seconds of 2 shared cores): plain DDP is dp2_accum4's, plain TP the
# 4-rank fsdp2_tp2_tied's, the chunked loss rides on GPipe, offload on FSDP2 with accumulation.
LAYOUTS = {
    "fsdp2": {"distributed.data_parallel_size": 2, "distributed.zero_optimization": 3, "data.batch_size": 4},
    "zero2_2": {"distributed.data_parallel_size": 2, "distributed.zero_optimization": 2, "data.batch_size": 4},
    "tp2_sp": {"distributed.tensor_parallel_size": 2, "distributed.sequence_parallel": True},
    # the registry's eager cross-entropy is the chunked one: the pipeline's loss follows the recipe
    "pp2_gpipe_chunked_loss": {
        "distributed.pipeline_parallel_size": 2,
        "distributed.pipeline_schedule": "gpipe",
        "data.batch_size": 4,
        "optim.grad_accum_steps": 2,
        "model.kernel_overrides": {"cross_entropy": "eager"},
    },
    "pp2_1f1b": {
        "distributed.pipeline_parallel_size": 2,
        "distributed.pipeline_schedule": "1f1b",
        "data.batch_size": 4,
        "optim.grad_accum_steps": 2,
    },
    # accumulation: DDP and ZeRO-1 synchronise once per step, ZeRO-3 per micro-batch; same losses
    "dp2_accum4": {"distributed.data_parallel_size": 2, "data.batch_size": 1, "optim.grad_accum_steps": 4},
    "zero1_accum4": {
        "distributed.data_parallel_size": 2,
        "distributed.zero_optimization": 1,
        "data.batch_size": 1,
        "optim.grad_accum_steps": 4,
    },
    "fsdp2_accum4_offload": {
        "distributed.data_parallel_size": 2,
        "distributed.zero_optimization": 3,
        "data.batch_size": 1,
        "optim.grad_accum_steps": 4,
        "optim.offload_optimizer": True,
    },
    # context parallel: each row cut in 4 chunks over 2 ranks, ring attention through the kernel registry's
    # attention op, its blocks on the registry's attention_block (auto: torch's flash attention for CPU), with full
    # recompute (the ring runs again in backward's recompute); transformers' attention
    # interface carries it in fsdp2_cp2 and tp2_sp_cp2 on 4 ranks
    "cp2_kernels_recompute": {
        "distributed.context_parallel_size": 2,
        "distributed.zero_optimization": 2,
        "model.kernels": "auto",
        "model.activation_checkpointing": "full",
    },
}
# FSDP2 with its MixedPrecisionPolicy (bf16 gathers, fp32 reduction and masters) against one process
# under bf16 autocast: the same math in another rounding order. Measured here: 3.2e-4 at most over 6 steps (the runs
# are 4 steps now).
BF16 = {"model.precision": "bf16"}
BF16_TOL = 1e-2
FSDP4 = {"distributed.data_parallel_size": 4, "distributed.zero_optimization": 3, "data.batch_size": 2}
FSDP2_TP2 = {
    "distributed.data_parallel_size": 2,
    "distributed.zero_optimization": 3,
    "distributed.tensor_parallel_size": 2,
    "data.batch_size": 4,
}
FSDP2_TP2_SP = {**FSDP2_TP2, "distributed.sequence_parallel": True}
CP2 = {"distributed.context_parallel_size": 2, "distributed.zero_optimization": 3}
FSDP2_CP2 = {**FSDP4, "distributed.data_parallel_size": 2, "data.batch_size": 4, **CP2}  # FSDP2 over dp x cp = 4
TP2_SP_CP2 = {"distributed.tensor_parallel_size": 2, "distributed.sequence_parallel": True, **CP2}
# each stage's slice of the rows: the schedule passes the inputs alone, the stages take positions from the layout
PP2_CP2 = {**LAYOUTS["pp2_1f1b"], **CP2}
TIED = {"model.overrides.tie_word_embeddings": True}
MOE = {"model.preset": "tiny-moe", "logging.ckpt_interval": 2}
EP2 = {"distributed.expert_parallel_size": 2}
MOE_LAYOUTS_2 = {"moe_fsdp2": {**MOE, **LAYOUTS["fsdp2"]}, "moe_ep2": {**MOE, **LAYOUTS["fsdp2"], **EP2}}


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir) if "loss" in r}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_cache):
    out = tmp_path_factory.mktemp("dist")
    base = {
        **FAST,
        "data.cache_dir": data_cache,
        "data.batch_size": 8,
        "optim.max_steps": 4,  # a run's time is mostly its steps: 4 with a checkpoint at 2 to resume from
        "logging.eval_interval": 2,
        "logging.eval_batches": 1,  # one global batch of 8 held-out rows, split over the data-parallel ranks
        "logging.ckpt_interval": 100,
    }
    run_layouts(
        str(TINY),
        out,
        base,
        [
            "single={}",
            f"single_bf16={json.dumps(BF16)}",  # references, here
            f"single_tied={json.dumps(TIED)}",
            "single_cut@2={}",  # a one-process checkpoint at step 2, resumed below on 2 ranks
        ],
    )
    moe_step3 = out / "moe_ep2_fsdp2" / "checkpoints" / "step_2"
    launch_layouts(
        TINY,
        out,
        4,
        base,
        {
            "fsdp2_tp2_sp": FSDP2_TP2_SP,
            "fsdp4@2": FSDP4,
            "fsdp2_tp2_tied": {**FSDP2_TP2, **TIED},
            "moe_fsdp4": {**MOE, **FSDP4},
            "moe_ep2_fsdp2": {**MOE, **FSDP4, **EP2},
            f"moe_ep2_fsdp2_resumed<{moe_step3}": {**MOE, **FSDP4, **EP2},
            f"moe_fsdp4_from_ep2<{moe_step3}": {**MOE, **FSDP4},
            "moe_ep2_tp2_sp": {**MOE, **FSDP2_TP2_SP, **EP2},
            "fsdp2_cp2": FSDP2_CP2,
            "tp2_sp_cp2": TP2_SP_CP2,
            "pp2_cp2": PP2_CP2,
        },
    )
    step3 = out / "fsdp4" / "checkpoints" / "step_2"
    single_step3 = out / "single_cut" / "checkpoints" / "step_2"
    # every 2-rank layout in one launch (a launch's start costs seconds), after the 4-rank one whose checkpoint the
    # last three resume
    log = launch_layouts(
        TINY,
        out,
        2,
        base,
        {
            **LAYOUTS,
            "fsdp2_bf16": {**LAYOUTS["fsdp2"], **BF16},
            **MOE_LAYOUTS_2,
            f"fsdp2_from4<{step3}": LAYOUTS["fsdp2"],
            f"cp2_from4<{step3}": CP2,
            f"fsdp2_from1<{single_step3}": LAYOUTS["fsdp2"],  # the data position is global: 1 rank -> 2
        },
    )
    (out / "launch2.log").write_text(log)
    run_layouts(str(TINY), out, base, [f"single_from4<{step3}={{}}"])
    return out


@pytest.mark.parametrize("layout", [*LAYOUTS, "fsdp2_tp2_sp", "fsdp2_cp2", "tp2_sp_cp2", "pp2_cp2"])
def test_layout_matches_single_process(runs, layout):
    ref, got = losses(runs / "single"), losses(runs / layout)
    assert sorted(got) == sorted(ref) == list(range(1, 5))
    diffs = {s: abs(got[s] - ref[s]) for s in ref}
    assert max(diffs.values()) < LOSS_TOL, diffs
    ref_val = [r["val_loss"] for r in read_metrics(runs / "single") if "val_loss" in r]
    got_val = [r["val_loss"] for r in read_metrics(runs / layout) if "val_loss" in r]
    assert len(got_val) == len(ref_val) == 3
    assert max(abs(a - b) for a, b in zip(got_val, ref_val)) < LOSS_TOL


# cp2: a CP change reshards; fsdp2_from1: a one-process checkpoint goes on with the same global draws on 2 ranks
@pytest.mark.parametrize("resumed", ["fsdp2_from4", "single_from4", "cp2_from4", "fsdp2_from1"])
def test_checkpoint_from_4_ranks_resumes_on_fewer(runs, resumed):
    ref = losses(runs / "single")
    assert sorted(losses(runs / "fsdp4")) == [1, 2]
    got = losses(runs / resumed)
    assert sorted(got) == [3, 4]
    assert max(abs(got[s] - ref[s]) for s in got) < LOSS_TOL, (got, ref)


def test_export_of_a_4_rank_checkpoint_equals_the_export_of_the_same_weights_from_1_rank(runs, tmp_path, data_cache):
    from safetensors.torch import load_file

    from canntrain_core.checkpoint.export import export_hf
    from canntrain_core.recipe import load_recipe
    from canntrain_core.train.trainer import Trainer

    step3 = runs / "fsdp4" / "checkpoints" / "step_2"
    base = {**FAST, "data.cache_dir": data_cache, "data.batch_size": 8, "optim.max_steps": 4}
    one = Trainer(load_recipe(TINY, base), run_dir=tmp_path / "one", resume_from=step3, progress=False)
    rewritten = one.save()  # the same weights, written by one rank
    a = export_hf(step3, tmp_path / "from4", max_shard_size="1MB")
    b = export_hf(rewritten, tmp_path / "from1", max_shard_size="1MB")
    assert a.files == b.files and len(a.files) > 1
    for name in a.files:
        ta, tb = load_file(a.out / name), load_file(b.out / name)
        assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)


def test_tied_embeddings_stay_one_tensor_under_fsdp2_tp2(runs, tmp_path):
    """tie_word_embeddings under FSDP2 x TP2 (the launch's TP without sequence parallel) trains the single process's
    curve, its checkpoint holds one
    matrix under both names, and its export (no lm_head.weight) loads with transformers to the single
    process's logits."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from transformers import AutoModelForCausalLM

    from canntrain_core.checkpoint.dcp import single_process_ok
    from canntrain_core.checkpoint.export import export_hf

    ref, got = losses(runs / "single_tied"), losses(runs / "fsdp2_tp2_tied")
    assert sorted(got) == sorted(ref) == list(range(1, 5))
    assert max(abs(got[s] - ref[s]) for s in ref) < LOSS_TOL
    assert max(abs(got[s] - losses(runs / "single")[s]) for s in ref) > 10 * LOSS_TOL  # tying changes the model
    ckpt = runs / "fsdp2_tp2_tied" / "checkpoints" / "step_4"
    meta = FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    pair = {k: torch.empty(meta[k].size) for k in ("model.model.embed_tokens.weight", "model.lm_head.weight")}
    with single_process_ok():
        dcp.load(pair, storage_reader=FileSystemReader(str(ckpt)))
    assert torch.equal(*pair.values())
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    logits = []
    for name in ("fsdp2_tp2_tied", "single_tied"):
        out = export_hf(runs / name, tmp_path / name)
        model = AutoModelForCausalLM.from_pretrained(out.out)
        assert model.lm_head.weight is model.model.embed_tokens.weight
        with torch.no_grad():
            logits.append(model(ids).logits)
    assert (logits[0] - logits[1]).abs().max() < 1e-3


def test_fsdp2_mixed_precision_matches_bf16_autocast(runs):
    ref, got = losses(runs / "single_bf16"), losses(runs / "fsdp2_bf16")
    assert sorted(got) == sorted(ref) == list(range(1, 5))
    assert max(abs(got[s] - ref[s]) for s in ref) < BF16_TOL, (got, ref)


def test_fsdp2_gets_the_mixed_precision_and_offload_policies():
    import torch
    from torch.distributed.fsdp import CPUOffloadPolicy

    from canntrain_core.memory.measure import fake_world
    from canntrain_core.models.lifecycle import build_meta_model
    from canntrain_core.models.registry import model_config
    from canntrain_core.recipe import load_recipe
    from canntrain_core.runtime.distributed import ParallelDims

    recipe = load_recipe(
        TINY,
        {
            "distributed.world_size": 2,
            "distributed.data_parallel_size": 2,
            "distributed.zero_optimization": 3,
            "model.precision": "bf16",
            "optim.offload_optimizer": True,
        },
    )
    with fake_world(2):
        dims = ParallelDims.from_recipe(recipe)
        model, _ = build_meta_model(
            recipe, model_config(recipe.model, 512), torch.device("cpu"), dims.build_mesh("cpu"), dims
        )
        groups = [m._get_fsdp_state()._fsdp_param_group for m in [*model.layers(), model]]
    assert all(isinstance(g.offload_policy, CPUOffloadPolicy) for g in groups)
    assert all(g.mp_policy.param_dtype == torch.bfloat16 and g.mp_policy.reduce_dtype == torch.float32 for g in groups)


def test_offload_on_a_cpu_host_says_it_is_a_no_op(runs):
    assert "optim.offload_optimizer: FSDP2's CPUOffloadPolicy is applied" in (runs / "launch2.log").read_text()
    assert "a no-op here" in (runs / "launch2.log").read_text()


@pytest.mark.parametrize(
    "ep, ref",
    [
        ("moe_ep2", "moe_fsdp2"),
        ("moe_ep2_fsdp2", "moe_fsdp4"),
        ("moe_ep2_tp2_sp", "moe_fsdp2"),
    ],
)
def test_expert_parallel_logs_the_losses_of_the_same_layout_without_it(runs, ep, ref):
    """With TP the MoE block runs whole on every tp rank (its router and experts replicated over tp): the router
    balance counted once, not once per tp rank."""
    got, want = losses(runs / ep), losses(runs / ref)
    assert sorted(got) == sorted(want) == list(range(1, 5))
    assert max(abs(got[s] - want[s]) for s in want) < LOSS_TOL
    rows = {name: [r for r in read_metrics(runs / name) if "loss" in r] for name in (ep, ref)}
    assert [r["aux_loss"] for r in rows[ep]] == pytest.approx([r["aux_loss"] for r in rows[ref]], abs=LOSS_TOL)
    assert [r["expert_tokens_mean"] for r in rows[ep]] == [r["expert_tokens_mean"] for r in rows[ref]]


def test_an_ep2_checkpoint_resumes_bit_for_bit_and_reshards_to_ep1(runs):
    full = losses(runs / "moe_ep2_fsdp2")
    resumed = losses(runs / "moe_ep2_fsdp2_resumed")
    assert sorted(resumed) == [3, 4]
    assert all(resumed[s] == full[s] for s in resumed)  # bit for bit
    resharded = losses(runs / "moe_fsdp4_from_ep2")
    assert max(abs(resharded[s] - full[s]) for s in resharded) < LOSS_TOL
