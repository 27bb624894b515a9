"""A mixture of experts (Mixtral's block): the router's load-balancing loss is transformers' formula, training
adds it as transformers' MixtralForCausalLM does (router_aux_loss_coef x it, evaluation leaves it out), and the
trainer logs it apart. Layout parity, init_from and export: tests/models/test_hf.py (parametrized over families)."""

from __future__ import annotations

import json

import pytest
import torch
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

from canntrain_core.models.lm import CausalLM
from canntrain_core.models.moe import load_balancing_loss
from canntrain_core.models.registry import build_model
from canntrain_core.train.trainer import Trainer


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


def test_training_loss_is_transformers_loss_with_router_loss():
    hf = build_model("tiny-moe", vocab_size=300, seed=0)
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


def test_expert_parallel_is_refused_until_the_trainer_runs_it():
    from canntrain_core.sizing.layout import Layout, layout_problems
    from canntrain_core.sizing.shapes import shape_from_preset

    layout = Layout(pp=1, dp=2, cp=1, tp=1, ep=2, zero=3)
    problems = layout_problems(layout, shape_from_preset("tiny-moe"))
    assert any("expert_parallel_size > 1" in p for p in problems), problems
