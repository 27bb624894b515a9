"""Kernel ops, registry and check harness on CPU (eager and compile; npu/cuda skip with a reason)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

import canntrain_kernels as kernels
from canntrain_kernels import registry
from canntrain_kernels.cases import make_case, parse_shape
from canntrain_kernels.check import check_one, run_check
from canntrain_kernels.memory import peak_bytes
from canntrain_kernels.reference import cross_entropy, plain_cross_entropy

OPS = list(kernels.OPS)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("shape", ["small", "odd", "window"])
@pytest.mark.parametrize("op", OPS)
def test_eager_matches_fp64_reference(op, shape, dtype):
    rec = check_one(op, "eager", dtype, shape, device="cpu", timing=False)
    assert rec.status == "pass", rec
    assert rec.bwd_rel is not None and rec.bwd_rel <= kernels.TOLERANCES[dtype]


@pytest.mark.parametrize("kv_heads", [8, 4, 2, 1])  # GQA ratios 1, 2, 4, 8
@pytest.mark.parametrize("op", ["attention", "apply_rotary"])
def test_gqa_ratios(op, kv_heads):
    rec = check_one(op, "eager", "fp32", f"odd:heads=8:kv_heads={kv_heads}", device="cpu", timing=False)
    assert rec.status == "pass", rec


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("op", [op for op in OPS if registry.kernel(op, "compile") is not None])
def test_compile_matches_fp64_reference(op, dtype):
    # The "verify" shape is the one the registry's auto check compiles too: one set of graphs.
    rec = check_one(op, "compile", dtype, "verify", device="cpu", timing=False)
    assert rec.status == "pass", rec


@pytest.mark.parametrize("backend", ["npu", "cuda"])
@pytest.mark.parametrize("op", OPS)
def test_device_backends(op, backend):
    reason = registry.unavailable_reason(op, backend)
    if reason is not None:
        pytest.skip(reason)
    rec = check_one(op, backend, "bf16", "odd", timing=False)
    assert rec.status == "pass", rec


def test_registry_never_selects_absent_devices():
    for op in OPS:
        for backend in ("npu", "cuda"):
            assert registry.unavailable_reason(op, backend, "cpu") is not None
            assert backend not in kernels.available_backends(op, "cpu")
            with pytest.raises(kernels.KernelUnavailable, match=backend):
                kernels.get(op, backend, device="cpu")
    assert kernels.select("swiglu", "eager", "cpu").backend == "eager"
    with pytest.raises(KeyError, match="unknown kernel op"):
        kernels.get("layer_norm")
    with pytest.raises(KeyError, match="choose one of"):
        kernels.get("swiglu", "tpu")


def test_auto_skips_a_backend_that_fails_its_check(monkeypatch):
    broken = registry.Kernel("swiglu", "compile", lambda g, u: torch.sigmoid(g) * u, devices=("cpu",))
    monkeypatch.setitem(registry._KERNELS, ("swiglu", "compile"), broken)
    monkeypatch.setattr(registry, "_VERIFIED", {})
    sel = kernels.select("swiglu", "auto", "cpu")
    assert sel.backend == "eager"
    assert "numerics" in sel.skipped["compile"]


def test_check_flags_a_wrong_kernel():
    # silu without the gate's own factor: plausible-looking, wrong by a lot.
    rec = check_one(
        "swiglu", "eager", "fp32", "small", device="cpu", timing=False, fn=lambda g, u: torch.sigmoid(g) * u
    )
    assert rec.status == "fail" and "tolerance" in rec.reason
    # Right forward, but the gradient of `up` is dropped (detached): only the backward check catches it.
    rec = check_one(
        "swiglu", "eager", "fp32", "small", device="cpu", timing=False, fn=lambda g, u: F.silu(g) * u.detach()
    )
    assert rec.status == "fail" and rec.fwd_rel < 1e-6
    # RMSNorm computed entirely in bf16: within fp32 tolerance? no; within bf16's? yes.
    bf16_stats = lambda x, w, eps: w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))  # noqa: E731
    assert check_one("rms_norm", "eager", "bf16", "small", "cpu", False, fn=bf16_stats).status == "pass"


def test_run_check_records_and_timing():
    recs = run_check(ops=["rms_norm"], backends=["eager", "npu"], dtypes=["fp32"], shapes=["small"], repeat=2)
    by_backend = {r.backend: r for r in recs}
    assert by_backend["npu"].status == "skip" and "npu" in by_backend["npu"].reason
    assert by_backend["eager"].status == "pass" and by_backend["eager"].fwd_bwd_ms > 0
    with pytest.raises(ValueError, match="unknown shape"):
        run_check(shapes=["huge"])
    assert parse_shape("small:seq=100").seq == 100


def test_cli_check(capsys, monkeypatch):
    from canntrain_core.cli import main

    argv = ["kernels", "check", "--ops", "swiglu,rms_norm", "--backends", "eager", "--dtypes", "fp32"]
    assert main(argv + ["--json", "--no-timing"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert {(r["op"], r["status"]) for r in lines} == {("swiglu", "pass"), ("rms_norm", "pass")}
    assert main(argv + ["--repeat", "2"]) == 0
    assert "f+b ms" in capsys.readouterr().out
    assert main(["kernels", "check", "--ops", "softmax"]) == 2
    broken = registry.Kernel("swiglu", "eager", lambda g, u: g * u, devices=("cpu",))
    monkeypatch.setitem(registry._KERNELS, ("swiglu", "eager"), broken)
    assert main(argv + ["--no-timing"]) == 1
    assert "swiglu/eager/fp32/small" in capsys.readouterr().err


# ------------------------------------------------------------------------- cross-entropy


def _ce_inputs(n=50, h=16, v=37, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    hid = torch.randn(n, h, generator=g, dtype=dtype)
    w = torch.randn(v, h, generator=g, dtype=dtype) / 4
    t = torch.randint(0, v, (n,), generator=g)
    t[::7] = -100
    return hid, w, t


@pytest.mark.parametrize("chunk", [1, 7, 50, 1000])
def test_chunked_cross_entropy_equals_plain(chunk):
    hid, w, t = _ce_inputs()
    a = [x.clone().requires_grad_() for x in (hid, w)]
    b = [x.clone().requires_grad_() for x in (hid, w)]
    la = cross_entropy(*a, t, chunk_size=chunk)
    lb = plain_cross_entropy(*b, t)
    (la * 3).backward()
    (lb * 3).backward()
    torch.testing.assert_close(la, lb, rtol=1e-12, atol=1e-12)
    for x, y in zip(a, b):
        torch.testing.assert_close(x.grad, y.grad, rtol=1e-10, atol=1e-12)


def test_chunked_cross_entropy_edge_cases():
    hid, w, t = _ce_inputs(dtype=torch.float32)
    assert torch.isnan(cross_entropy(hid, w, torch.full_like(t, -100))) and torch.isnan(
        F.cross_entropy(hid @ w.t(), torch.full_like(t, -100))
    )
    with torch.no_grad():  # no gradients needed: none computed, same value
        torch.testing.assert_close(cross_entropy(hid, w, t, chunk_size=8), plain_cross_entropy(hid, w, t))
    with pytest.raises(ValueError, match="expects hidden"):
        cross_entropy(hid[None], w, t)
    with pytest.raises(ValueError, match="chunk_size"):
        cross_entropy(hid, w, t, chunk_size=0)
    lb = cross_entropy(hid.bfloat16(), w.bfloat16(), t)
    assert lb.dtype == torch.float32
    torch.testing.assert_close(lb, plain_cross_entropy(hid.bfloat16(), w.bfloat16(), t))


def test_chunked_cross_entropy_peak_memory_is_lower():
    n, h, v = 512, 32, 2048
    case = make_case("cross_entropy", parse_shape(f"small:batch=1:seq={n}:hidden={h}:vocab={v}"), torch.float32)
    hid, w, t = case.args

    def step(fn, **kw):
        a, b = hid.clone().requires_grad_(), w.clone().requires_grad_()
        return lambda: fn(a, b, t, **kw).backward()

    plain = peak_bytes(step(plain_cross_entropy))
    chunked = peak_bytes(step(cross_entropy, chunk_size=64))
    logits_bytes = n * v * 4
    assert plain >= 2 * logits_bytes  # logits and their gradient, at least
    assert chunked < logits_bytes  # never even one full [N, V] fp32 logits tensor


@pytest.mark.parametrize("dtype", ["fp64", "fp32", "bf16"])
@pytest.mark.parametrize("shape", ["small", "odd"])  # odd: 37 rows in tiles of 12, 8 query heads per K/V head
def test_cpu_flash_attention_block_matches_fp64_reference(shape, dtype):
    rec = check_one("attention_block", "cpu", dtype, shape, device="cpu", timing=False)
    assert rec.status == "pass", rec


@pytest.mark.parametrize("backend", ["eager", "cpu"])
def test_an_off_diagonal_block_of_packed_rows_leaves_rows_without_keys_at_zero(backend):
    """A ring's block from another rank (rectangular, no causal mask) where some queries' documents have no key
    in it: those rows give output 0 and lse -inf (the merge ignores them); the others match the definition."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 4, n, 8, generator=g, dtype=torch.float64) for n in (6, 5, 5))
    seg_q = torch.tensor([[0, 0, 1, 1, 2, 2], [1, 1, 1, 1, 1, 1]])
    seg_k = torch.tensor([[0, 0, 0, 1, 1], [0, 0, 0, 0, 0]])  # document 2 (row 0) and 1 (row 1) see nothing
    dout = torch.randn(2, 4, 6, 8, generator=g, dtype=torch.float64)
    results = []
    for fn in (kernels.reference.attention_block, registry.kernel("attention_block", backend).fn):
        leaves = [t.clone().requires_grad_() for t in (q, k[:, :2], v[:, :2])]
        out, lse = fn(*leaves, causal=False, seg_q=seg_q, seg_k=seg_k, tile=4)
        results.append((out, lse, torch.autograd.grad(out, leaves, dout)))
    (want, want_lse, want_grads), (out, lse, grads) = results
    blind = torch.tensor([[False, False, False, False, True, True], [True] * 6])[:, None].expand(2, 4, 6)
    assert torch.isneginf(lse[blind]).all() and torch.isfinite(lse[~blind]).all()
    assert out[blind].abs().max() == 0
    torch.testing.assert_close(lse[~blind], want_lse[~blind], rtol=0, atol=1e-12)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
    for got, ref in zip(grads, want_grads):
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-12)


def test_a_default_backend_without_an_op_runs_it_eager_and_an_override_stays_strict():
    assert registry.resolve("compile")["expert_mlp"] == "eager"
    assert registry.resolve("compile")["attention_block"] == "eager"
    assert registry.resolve("cpu") == {**{op: "eager" for op in OPS}, "attention_block": "cpu"}
    assert registry.resolve("auto")["attention_block"] == "auto"
    assert kernels.select("attention_block", "auto", "cpu").backend == "cpu"
    with pytest.raises(kernels.KernelUnavailable, match="backend 'compile' has no attention_block kernel"):
        kernels.select("attention_block", registry.resolve("eager", {"attention_block": "compile"})["attention_block"])
