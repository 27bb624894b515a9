"""A mixture of experts (Mixtral's block): the router's load-balancing loss is transformers' formula, training
adds it as transformers' MixtralForCausalLM does (router_aux_loss_coef x it, evaluation leaves it out), and the
trainer logs it apart. Layout parity, init_from and export: tests/models/test_hf.py (parametrized over families)."""

from __future__ import annotations

import json

import pytest
import torch
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

from canntrain_core.families import FAMILIES
from canntrain_core.models.lm import CausalLM
from canntrain_core.models.moe import load_balancing_loss
from canntrain_core.models.registry import build_model
from canntrain_core.sizing.layout import Layout, layout_problems
from canntrain_core.sizing.shapes import shape_from_preset
from canntrain_core.train.trainer import Trainer

TINY = shape_from_preset("tiny")


def test_load_balancing_loss_is_transformers_formula():
    g = torch.Generator().manual_seed(0)
    layers = [torch.randn(10, 8, generator=g) * 3 for _ in range(3)]
    for top_k in (1, 2):
        want = load_balancing_loss_func(tuple(layers), num_experts=8, top_k=top_k)
        assert load_balancing_loss(layers, 8, top_k).item() == pytest.approx(want.item(), rel=1e-6)


def test_load_balancing_loss_by_hand():
    """E x sum_i f_i x P_i: one token per expert (f = P = 1/E) gives 1 for top-1; every token on expert 0
    gives E."""
    even = torch.eye(4) * 50.0  # token t routes to expert t with probability ~1
    assert load_balancing_loss([even], 4, 1).item() == pytest.approx(1.0, abs=1e-6)
    one = torch.zeros(4, 4)
    one[:, 0] = 50.0
    assert load_balancing_loss([one], 4, 1).item() == pytest.approx(4.0, abs=1e-6)


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
