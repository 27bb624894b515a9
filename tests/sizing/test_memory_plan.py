"""Plan search, the CLI and the OOM hint."""

from __future__ import annotations

import json

import pytest
import torch

from canntrain_core.sizing.presets import PRESETS

from canntrain_core.cli import main
from canntrain_core.memory import GiB, TrainSetup, get_device, oom_hint, shape_from_preset, shape_from_recipe
from canntrain_core.recipe import load_recipe
from canntrain_core.sizing.estimator import estimate
from canntrain_core.sizing.plan import search, suggest_when_nothing_fits
from canntrain_core.sizing.setup import setup_from_recipe
from conftest import ROOT

CAP = 64 * GiB


@pytest.fixture(scope="module")
def plans32():
    return search(shape_from_preset("llama2-70b"), 32, get_device("910b"), 8, 1024, memory_bytes=CAP)


def test_70b_on_16_devices_of_64gib_has_no_plan_and_says_what_would_fit():
    shape, dev = shape_from_preset("llama2-70b"), get_device("910b")
    plans = search(shape, 16, dev, 8, 1024, memory_bytes=CAP)
    assert plans and not any(p.fits for p in plans)
    assert all(p.reason for p in plans)
    # model states alone: 16 B x 69 B / 16 = 64.2 GiB > 64 GiB, whatever the split
    assert all(p.estimate is None or p.estimate.model_states > CAP * 0.9 for p in plans)
    hints = suggest_when_nothing_fits(shape, 16, dev, 8, 1024, TrainSetup(), CAP)
    assert "64.2 GiB" in hints[0]
    assert any("32 devices" in h for h in hints) and any("offload" in h for h in hints)


def test_70b_on_32_devices_every_plan_multiplies_out_and_fits(plans32):
    fitting = [p for p in plans32 if p.fits]
    assert fitting
    for p in fitting:
        s = p.setup
        assert s.tp * s.pp * s.dp * s.cp == 32
        assert p.estimate.total <= CAP
        assert s.micro_batch * s.dp * s.grad_accum == 1024
    times = [p.step_time for p in fitting]
    assert times == sorted(times)
    assert all(p.reason for p in plans32 if not p.fits)
    best = fitting[0].setup
    assert best.tp <= 8  # TP kept inside a node


def test_plan_cli_exit_codes_and_json(capsys):
    assert main(["plan", "--model", "llama2-70b", "--devices", "16", "--device-memory", "64GiB"]) == 1
    assert "nothing fits" in capsys.readouterr().out
    assert main(["plan", "--model", "llama2-7b", "--devices", "8", "--json", "--global-batch", "64"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["plans"] and all(p["fits"] for p in out["plans"])


def test_estimate_cli_json_has_bytes_per_category_per_method(tmp_path, capsys):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model: {preset: tiny, precision: bf16}\ndata: {seq_length: 64, batch_size: 2}\n")
    assert main(["estimate", str(recipe), "--measure", "--json", "--set", "data.batch_size=4"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) >= {"analytic", "measured", "comparison"}
    assert out["analytic"]["categories"]["parameters"] == out["measured"]["states"]["parameters"]
    rows = {r["name"]: r for r in out["comparison"]}
    assert abs(rows["total peak (tracked)"]["rel_error"]) < 0.10
    assert main(["estimate", str(recipe), "--set", "model.activation_checkpointing=sometimes"]) == 2


def test_oom_hint_names_a_change_that_fits():
    recipe = load_recipe(
        None,
        {
            "model.preset": "llama2-7b",
            "model.precision": "bf16",
            "data.batch_size": 8,
            "data.seq_length": 4096,
            "distributed.world_size": 8,
            "distributed.data_parallel_size": 8,
            "distributed.zero_optimization": 3,
        },
    )
    hint = oom_hint(recipe, 64 * GiB, shape_from_recipe(recipe))
    assert "against 64.00 GiB" in hint
    assert "try: --set model.activation_checkpointing=" in hint
    big = load_recipe(None, {"model.preset": "llama2-70b"})
    assert "no single change" in oom_hint(big, 8 * GiB, shape_from_recipe(big))


def test_oom_hint_suggests_expert_parallelism_for_a_mixture_of_experts():
    """Mixtral 8x7B on 32 ranks, ZeRO-3, full recompute, micro-batch 1: nothing cheaper is left, and splitting each
    layer's experts over 2 ranks fits where every rank gathering all 8 of a layer's experts does not."""
    recipe = load_recipe(
        ROOT / "cookbook" / "moe" / "configs" / "mixtral_8x7b_pretrain.yaml",
        {"distributed.expert_parallel_size": 1, "data.batch_size": 1},
    )
    shape, setup = shape_from_recipe(recipe), setup_from_recipe(recipe)
    ep1, ep2 = estimate(shape, setup).total, estimate(shape, setup.but(ep=2)).total
    assert ep2 < ep1
    hint = oom_hint(recipe, (ep1 + ep2) / 2, shape)
    assert f"try: --set distributed.expert_parallel_size=2  (estimated {ep2 / GiB:.2f} GiB)" in hint


# Parameter counts of the public Llama-3.1 and 3.2 checkpoints (their model cards' safetensors totals).
LLAMA3 = {
    "llama3-8b": 8_030_261_248,
    "llama3-70b": 70_553_706_496,
    "llama3.2-1b": 1_235_814_400,
    "llama3.2-3b": 3_212_749_824,
}


@pytest.mark.parametrize("preset", list(LLAMA3))
def test_llama3_presets_are_the_public_models_for_the_builder_and_the_estimator(preset):
    from canntrain_core.models.registry import build_model, count_parameters

    model = build_model(preset, device="meta")
    assert count_parameters(model) == shape_from_preset(preset).num_params() == LLAMA3[preset]
    assert model.config.rope_parameters["rope_type"] == "llama3" and model.config.vocab_size == 128256
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == preset.startswith("llama3.2")


# Parameter counts of the other families' public checkpoints (their model cards' safetensors totals).
PUBLIC = {
    "qwen2.5-0.5b": 494_032_768,
    "qwen2.5-7b": 7_615_616_512,
    "qwen2.5-72b": 72_706_203_648,
    "qwen3-0.6b": 596_049_920,
    "qwen3-8b": 8_190_735_360,
    "qwen3-32b": 32_762_123_264,
    "mistral-7b": 7_248_023_552,
    "gpt2": 124_439_808,  # openai-community/gpt2: the head tied, 1,024 learned positions
    "gpt2-medium": 354_823_168,
    "gpt2-large": 774_030_080,
    "gpt2-xl": 1_557_611_200,
    "mixtral-8x7b": 46_702_792_704,  # every expert counted; 12,879,925,248 active per token
    "mixtral-8x22b": 140_630_071_296,
    "qwen3-30b-a3b": 30_532_122_624,  # 3,353,032,704 active per token
    "qwen3-235b-a22b": 235_093_634_560,
    "qwen1.5-moe-a2.7b": 14_315_784_192,  # 2,689,173,504 active per token, the shared expert included
    "qwen2-57b-a14b": 57_408_658_944,
}


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_preset_counts_the_same_in_the_builder_and_the_estimator(preset):
    """The family's class on meta (canntrain's own tree where it has one, and transformers' too), and the
    estimator's shape agree on every preset, biases and per-head norms included; the public ones equal the
    published totals."""
    from canntrain_core.families import PRESET_FAMILY
    from canntrain_core.models.classes import causal_lm_class
    from canntrain_core.models.registry import build_model, count_parameters

    model = build_model(preset, device="meta")
    family = PRESET_FAMILY[preset]
    assert type(model).__name__ == (family.own_class or family.causal_lm_class)
    with torch.device("meta"):
        theirs = causal_lm_class(model.config)(model.config)
    assert (
        count_parameters(model)
        == count_parameters(theirs)
        == shape_from_preset(preset).num_params()
        == PUBLIC.get(preset, LLAMA3.get(preset, count_parameters(model)))
    )
    tied = model.config.tie_word_embeddings
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied


def test_the_planner_never_splits_a_tied_model_over_pipeline_stages():
    plans = search(shape_from_preset("llama3.2-1b"), 8, get_device("910b"), 8, 1024, memory_bytes=CAP)
    assert any(p.fits for p in plans)
    assert all(p.setup.pp == 1 for p in plans if p.fits)
    untied = search(shape_from_preset("llama3-8b"), 8, get_device("910b"), 8, 1024, memory_bytes=CAP)
    assert any(p.fits and p.setup.pp > 1 for p in untied)  # the rule is the tie, not the size


def _best(preset: str, devices: int, vocab_parallel: bool):
    """The fastest plan that leaves 10 % of a 910B's 64 GiB to spare (the shipped recipes' rule)."""
    base = TrainSetup(vocab_parallel=vocab_parallel)
    dev = get_device("910b")
    plans = search(shape_from_preset(preset), devices, dev, 8, 128, base=base, memory_bytes=0.9 * CAP)
    return next(p for p in plans if p.fits)


def test_a_vocabulary_parallel_head_changes_what_the_planner_recommends():
    """At Llama 3's and Qwen's vocabularies the replicated head is a large share of a rank: llama3-8b on 8 x 910B
    fits TP2 x DP4 only with the head split over the vocabulary (replicated, the best is a pipeline); qwen2.5-72b
    on 32 fits a pipeline (TP4 x PP8) only so, and its best step is 1.9x faster for it by the cost model."""
    split, whole = _best("llama3-8b", 8, True), _best("llama3-8b", 8, False)
    assert (split.setup.tp, split.setup.pp) == (2, 1) and whole.setup.pp > 1
    split, whole = _best("qwen2.5-72b", 32, True), _best("qwen2.5-72b", 32, False)
    assert split.setup.pp > 1 and whole.setup.pp == 1
    assert whole.step_time > 1.8 * split.step_time


def test_every_fitting_long_context_plan_with_cp_is_a_recipe_the_trainer_accepts():
    """Llama 3 8B at 32k tokens on 8 910B: the planner ranks context-parallel layouts first, and each fitting one
    it offers, written as a recipe, passes the trainer's own checks (the recipe's and the model-aware validator)."""
    from canntrain_core.memory.measure import recipe_for
    from canntrain_core.sizing.layout import check_layout

    shape = shape_from_preset("llama3-8b")
    base = TrainSetup(seq_length=32768)
    plans = [p for p in search(shape, 8, get_device("910b"), 8, 32, base, memory_bytes=0.9 * CAP) if p.fits]
    assert plans[0].setup.cp > 1
    with_cp = [p for p in plans if p.setup.cp > 1]
    assert len(with_cp) >= 5
    for p in with_cp:
        check_layout(recipe_for(shape, p.setup), shape, 8)


def test_the_oom_hint_suggests_context_parallel_for_long_rows():
    recipe = load_recipe(
        ROOT / "cookbook/llama/configs/llama3_8b_sft_32k.yaml",
        {"distributed.context_parallel_size": 1, "distributed.data_parallel_size": 8, "optim.grad_accum_steps": 4},
    )
    hint = oom_hint(recipe, CAP, shape_from_recipe(recipe))
    # the smallest split that fits: 2 and 4 ranks a row do not (the rows' activations stay too large)
    fix = "try: --set distributed.context_parallel_size=8 distributed.data_parallel_size=1 optim.grad_accum_steps=32"
    assert fix in hint, hint
