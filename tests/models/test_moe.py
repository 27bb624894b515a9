"""A mixture of experts (Mixtral's block): the router's load-balancing loss is transformers' formula, training
adds it as transformers' MixtralForCausalLM does (router_aux_loss_coef x it, evaluation leaves it out), and the
trainer logs it apart. Layout parity, init_from and export: tests/models/test_hf.py (parametrized over families)."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from transformers import MixtralConfig
from transformers.models.mixtral.modeling_mixtral import MixtralExperts, load_balancing_loss_func

from canntrain_core.families import FAMILIES
import canntrain_kernels as kernels
from canntrain_core.models.fused import apply_kernels
from canntrain_core.models.lm import CausalLM
from canntrain_core.recipe import ModelConfig
from canntrain_core.models.moe import expert_capacity, expert_tokens, load_balancing_loss
from canntrain_core.models.registry import build_model
from canntrain_core.parallel.expert import routed, within_capacity
from canntrain_core.sizing.layout import Layout, layout_problems
from canntrain_core.sizing.shapes import shape_from_preset
from canntrain_core.train.trainer import Trainer

TINY = shape_from_preset("tiny")


def test_load_balancing_loss_is_transformers_formula():
    g = torch.Generator().manual_seed(0)
    layers = [torch.randn(10, 8, generator=g) * 3 for _ in range(3)]
    for top_k in (1, 2):
        want = load_balancing_loss_func(tuple(layers), num_experts=8, top_k=top_k)
        assert load_balancing_loss(layers, expert_tokens(layers, 8, top_k)).item() == pytest.approx(
            want.item(), rel=1e-6
        )


def test_load_balancing_loss_by_hand():
    """E x sum_i f_i x P_i: one token per expert (f = P = 1/E) gives 1 for top-1; every token on expert 0
    gives E."""
    even = torch.eye(4) * 50.0  # token t routes to expert t with probability ~1
    assert load_balancing_loss([even], expert_tokens([even], 4, 1)).item() == pytest.approx(1.0, abs=1e-6)
    one = torch.zeros(4, 4)
    one[:, 0] = 50.0
    assert load_balancing_loss([one], expert_tokens([one], 4, 1)).item() == pytest.approx(4.0, abs=1e-6)


@pytest.mark.parametrize("preset", [f.tiny for f in FAMILIES.values() if f.router_class])
def test_training_loss_is_transformers_loss_with_router_loss(preset):
    """Every mixture-of-experts family: transformers' own training loss (its output_router_logits) and aux_loss."""
    hf = build_model(preset, vocab_size=300, seed=0)
    model = CausalLM(hf).train()
    ids = torch.randint(0, 300, (2, 17), generator=torch.Generator().manual_seed(1))
    x, t = ids[:, :-1], ids[:, 1:]
    with torch.no_grad():
        out = hf(x, output_router_logits=True)
        ce = torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), t.flatten())
        loss = model(x, t)
        assert loss.item() == pytest.approx((ce + hf.config.router_aux_loss_coef * out.aux_loss).item(), rel=1e-6)
        assert model.aux_loss.item() == pytest.approx(out.aux_loss.item(), rel=1e-6)
        assert model.eval()(x, t).item() == pytest.approx(ce.item(), rel=1e-6)  # validation: cross-entropy only


def test_the_trainer_logs_the_router_loss(tmp_path, fast_recipe):
    recipe = fast_recipe(**{"model.preset": "tiny-moe", "optim.max_steps": 4, "logging.log_interval": 2})
    Trainer(recipe, run_dir=tmp_path / "run", progress=False).fit()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    aux = [r["aux_loss"] for r in rows if "loss" in r]
    assert len(aux) == 2 and all(0 < a <= 8 * 2 for a in aux)  # between balanced and every token on one expert
    routed = 2 * recipe.data.batch_size * recipe.data.seq_length * 2  # per log interval: steps x tokens x top-2
    for r in (r for r in rows if "loss" in r):
        assert [sum(layer) for layer in r["expert_tokens"]] == [routed] * 4  # four layers, every token twice
        assert r["expert_tokens_mean"] == routed / 8
        assert r["expert_tokens_min"] == min(map(min, r["expert_tokens"])) <= routed / 8 <= r["expert_tokens_max"]


def test_expert_parallel_borrows_fsdp_ranks():
    moe = shape_from_preset("tiny-moe")
    assert layout_problems(Layout(dp=2, ep=2, zero=3), moe) == []
    assert any("needs zero_optimization >= 1" in p for p in layout_problems(Layout(dp=2, ep=2, zero=0), moe))
    assert any("must divide the model's 1 expert" in p for p in layout_problems(Layout(dp=2, ep=2, zero=3), TINY))
    assert Layout(dp=2, ep=4, zero=3).size_problem() == (
        "expert_parallel_size=4 must divide data_parallel_size x context_parallel_size = 2"
    )


def test_the_balance_plot_reads_the_logged_counts(tmp_path):
    from canntrain_core.viz.plots import expert_balance_figure

    rows = [
        {
            "step": 2,
            "loss": 5.0,
            "expert_tokens": [[3, 1], [2, 2]],
            "expert_tokens_min": 1,
            "expert_tokens_mean": 2,
            "expert_tokens_max": 3,
        },
        {
            "step": 4,
            "loss": 4.0,
            "expert_tokens": [[2, 2], [4, 0]],
            "expert_tokens_min": 0,
            "expert_tokens_mean": 2,
            "expert_tokens_max": 4,
        },
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    fig = expert_balance_figure(tmp_path)
    busiest, idlest = fig.axes[0].lines[:2]
    assert list(busiest.get_ydata()) == [1.5, 2.0] and list(idlest.get_ydata()) == [0.5, 0.0]
    assert fig.axes[1].images[0].get_array().tolist() == [[0.5, 0.5], [1.0, 0.0]]  # the last interval's shares
    with pytest.raises(ValueError, match="no expert_tokens"):
        (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 1.0}) + "\n")
        expert_balance_figure(tmp_path)


def test_within_capacity_keeps_each_experts_highest_router_weights():
    top_k = torch.tensor([[0, 1], [0, 2], [0, 1], [1, 0]])
    weights = torch.tensor([[0.5, 0.5], [0.9, 0.1], [0.7, 0.3], [0.6, 0.4]])
    keep = within_capacity(top_k, weights, 2, 3)
    # expert 0's pairs weigh 0.5, 0.9, 0.7, 0.4: the 0.9 and 0.7 stay; expert 1's 0.5, 0.3, 0.6: the 0.6 and 0.5
    assert keep.tolist() == [[False, True], [True, True], [True, False], [True, False]]


def test_experts_over_capacity_compute_transformers_output_without_the_dropped_pairs():
    config = MixtralConfig(hidden_size=16, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2)
    config._experts_implementation = "eager"
    theirs = MixtralExperts(config).double()
    for p in theirs.parameters():
        torch.nn.init.normal_(p, std=0.2)
    ours = MixtralExperts(config).double()
    ours.load_state_dict(theirs.state_dict())
    g = torch.Generator().manual_seed(0)
    x = torch.randn(9, 16, generator=g, dtype=torch.float64)
    top_k = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(9)])
    weights = torch.rand(9, 2, generator=g, dtype=torch.float64)
    for factor in (0.5, 1.0, 4.0):  # capacities 3, 5 and every pair
        route_experts_of(ours, factor)
        keep = within_capacity(top_k, weights, expert_capacity(9, 4, 2, factor), 4)
        assert (factor < 4.0) == (not keep.all())
        with torch.no_grad():
            assert torch.allclose(ours(x, top_k, weights), theirs(x, top_k, weights * keep), rtol=0, atol=1e-12)


def route_experts_of(experts, factor):
    """``parallel.expert.route_experts``'s forward on one experts module (no model around it)."""
    experts.ep_group, experts.capacity_factor = None, factor
    routed(experts)


def test_the_trainer_counts_the_assignments_over_capacity(tmp_path, fast_recipe):
    """Capacity 0.5 x an even share: each log row (one micro-batch) drops what its counts exceed capacity by;
    a capacity no expert reaches drops nothing and trains transformers' routing (the run without a capacity)."""
    runs = {}
    for factor in (0.5, 8.0, None):
        recipe = fast_recipe(
            **{"model.preset": "tiny-moe", "optim.max_steps": 3, "model.expert_capacity_factor": factor}
        )
        Trainer(recipe, run_dir=tmp_path / str(factor), progress=False).fit()
        runs[factor] = [
            json.loads(line) for line in (tmp_path / str(factor) / "metrics.jsonl").read_text().splitlines()
        ]
        runs[factor] = [r for r in runs[factor] if "loss" in r]
    tokens = recipe.data.batch_size * recipe.data.seq_length
    capacity = math.ceil(0.5 * tokens * 2 / 8)
    for r in runs[0.5]:
        want = sum(max(0, c - capacity) for layer in r["expert_tokens"] for c in layer)
        assert r["dropped_tokens"] == want >= 4 * tokens  # at least half of every layer's 2 x tokens pairs
        assert r["dropped_fraction"] == want / (4 * 2 * tokens)
    assert all(r["dropped_tokens"] == 0 for r in runs[8.0])
    assert "dropped_tokens" not in runs[None][0]
    assert [r["loss"] for r in runs[8.0]] == pytest.approx([r["loss"] for r in runs[None]], abs=1e-5)
    assert runs[0.5][-1]["loss"] != pytest.approx(runs[None][-1]["loss"], abs=1e-3)


@pytest.mark.parametrize("preset", [f.tiny for f in FAMILIES.values() if f.router_class])
def test_the_kernels_run_the_experts_through_the_registry(preset):
    """model.kernels (here auto on CPU: the loop, eager) routes each family's experts through the registry's
    expert_mlp: transformers' logits (fp32)."""
    hf = build_model(preset, vocab_size=300, seed=0)
    ids = torch.randint(0, 300, (2, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(ids).logits
        fused = apply_kernels(copy.deepcopy(hf), ModelConfig(preset=preset, kernel_overrides={"expert_mlp": "auto"}))
        assert fused.canntrain_kernels["expert_mlp"].backend == "eager"
        experts = next(m for m in fused.modules() if hasattr(m, "expert_kernel"))
        assert experts.expert_kernel is kernels.get("expert_mlp", "eager")
        assert (fused(ids).logits - want).abs().max() < 1e-5
