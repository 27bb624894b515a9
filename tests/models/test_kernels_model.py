"""The llama model wired to the kernel registry: same loss and gradients as stock transformers."""

from __future__ import annotations

import copy

import pytest
import torch

import canntrain_kernels as kernels
from canntrain_core.models.fused import FusedLlamaAttention, apply_kernels, describe, loss_cross_entropy
from canntrain_core.models.registry import build_model
from canntrain_core.recipe import ModelConfig
from canntrain_core.models.lm import causal_lm_loss

VOCAB = 300


@pytest.fixture(scope="module")
def stock():
    return build_model("tiny", {"num_hidden_layers": 2}, vocab_size=VOCAB, seed=3)


@pytest.fixture(scope="module")
def batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (2, 37), generator=g)  # 37: not a multiple of any block
    return ids, torch.roll(ids, -1, dims=1)


def _loss_and_grads(model, batch, cross_entropy=None):
    model.zero_grad()
    kw = {} if cross_entropy is None else {"cross_entropy": cross_entropy}
    loss = causal_lm_loss(model, *batch, **kw)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_eager_kernels_match_stock_transformers(stock, batch):
    ref_loss, ref_grads = _loss_and_grads(stock, batch)
    model = copy.deepcopy(stock)
    cfg = ModelConfig(kernels="eager")
    apply_kernels(model, cfg)
    assert set(model.state_dict()) == set(stock.state_dict())
    assert all(type(layer.self_attn) is FusedLlamaAttention for layer in model.model.layers)
    # The fused attention path really runs (not the stock fallback).
    calls = []
    for layer in model.model.layers:
        fn = layer.self_attn._attention
        layer.self_attn._attention = lambda *a, _fn=fn, **k: calls.append(1) or _fn(*a, **k)
    loss, grads = _loss_and_grads(model, batch, loss_cross_entropy(cfg))
    assert len(calls) == len(model.model.layers)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-5, msg=name)
    assert "attention: eager" in describe(model)


def test_auto_kernels_match_eager(stock, batch):
    eager = apply_kernels(copy.deepcopy(stock), ModelConfig(kernels="eager"))
    ref_loss, ref_grads = _loss_and_grads(eager, batch, loss_cross_entropy(ModelConfig(kernels="eager")))
    cfg = ModelConfig(kernels="auto")
    auto = apply_kernels(copy.deepcopy(stock), cfg)
    chosen = {op: sel.backend for op, sel in auto.canntrain_kernels.items()}
    assert set(chosen.values()) <= {"compile", "eager"}  # never npu/cuda on a CPU
    loss, grads = _loss_and_grads(auto, batch, loss_cross_entropy(cfg))
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-3, atol=1e-5, msg=name)


def test_overrides_and_errors(stock):
    model = copy.deepcopy(stock)
    cfg = {"kernels": "eager", "kernel_overrides": {"attention": "npu"}}
    with pytest.raises(kernels.KernelUnavailable, match="attention backend 'npu' is not available"):
        apply_kernels(model, cfg)
    assert loss_cross_entropy({"kernels": "eager"}) is kernels.get("cross_entropy", "eager")
    with pytest.raises(kernels.KernelUnavailable, match="cuda"):
        loss_cross_entropy(ModelConfig(kernels="eager", kernel_overrides={"cross_entropy": "cuda"}))
    gelu = build_model("tiny", {"num_hidden_layers": 1, "hidden_act": "gelu"}, vocab_size=VOCAB)
    with pytest.raises(ValueError, match="hidden_act"):
        apply_kernels(gelu, ModelConfig())
    with pytest.raises(TypeError, match="no norm, MLP or attention modules"):
        apply_kernels(torch.nn.Linear(2, 2), ModelConfig())


def test_a_family_without_fused_modules_runs_the_loss_kernel_only():
    """GPT-2's LayerNorm, GELU MLP and learned positions are no Llama block: the recipe's kernels choose its loss,
    and describe() names only that."""
    gpt2 = apply_kernels(build_model("tiny-gpt2", vocab_size=VOCAB), ModelConfig(kernels="auto"))
    assert set(gpt2.canntrain_kernels) == {"cross_entropy"}
    assert describe(gpt2).startswith("cross_entropy")


def test_generation_still_works(stock):
    ids = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(1))
    fused = apply_kernels(copy.deepcopy(stock), ModelConfig(kernels="eager")).eval()
    plain = copy.deepcopy(stock).eval()
    kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(fused.generate(ids, **kw), plain.generate(ids, **kw))
