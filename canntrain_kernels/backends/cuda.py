"""The cuda backend: Triton kernels for RMSNorm, RoPE and SwiGLU; torch's fused SDPA for attention.

Attention without a window runs ``F.scaled_dot_product_attention(is_causal=True, enable_gqa=True)``,
which dispatches to FlashAttention-2 / memory-efficient kernels on the GPU. With a sliding window
it passes a boolean mask (memory-efficient path). The loss is the chunked cross-entropy, whose
per-chunk matmuls run in cuBLAS.

Import-safe without triton or a GPU: the kernels are then unavailable, with the reason.
"""

from __future__ import annotations

import functools
import importlib

import torch
import torch.nn.functional as F

from canntrain_kernels import reference
from canntrain_kernels.cross_entropy import chunked_cross_entropy
from canntrain_kernels.registry import Kernel, register


def _probe_gpu() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    return None


@functools.lru_cache(maxsize=1)
def _triton_reason() -> str | None:
    try:
        importlib.import_module("triton")
    except Exception as e:
        return f"triton is not installed ({type(e).__name__}: {e})"
    return None


def _probe_triton() -> str | None:
    return _probe_gpu() or _triton_reason()


@functools.lru_cache(maxsize=1)
def _tk():
    return importlib.import_module("canntrain_kernels.backends.triton_kernels")


def rms_norm(x, weight, eps: float = 1e-5):
    """RMSNorm, one Triton program per row; backward accumulates dW per program."""
    return _tk().RMSNormFn.apply(x, weight, eps)


def apply_rotary(q, k, cos, sin):
    """RoPE on q and k with one Triton program per (batch, head, position) row."""
    return _tk().RoPEFn.apply(q, k, cos, sin)


def swiglu(gate, up):
    """silu(gate) * up as one elementwise Triton kernel (and one for its backward)."""
    return _tk().SwiGLUFn.apply(gate, up)


def attention(q, k, v, causal: bool = True, window: int | None = None, scale: float | None = None):
    """torch's fused scaled-dot-product attention (flash path when there is no window)."""
    if window is None and (not causal or q.shape[-2] == k.shape[-2]):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=True)
    # A window, or queries aligned to the end of longer keys (SDPA's is_causal aligns to the start).
    keep = reference.attention_mask(q.shape[-2], k.shape[-2], causal, window, device=q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=scale, enable_gqa=True)


def cross_entropy(hidden, weight, targets, ignore_index: int = -100, chunk_size: int | None = None):
    """The chunked cross-entropy of the reference, on the GPU."""
    return chunked_cross_entropy(hidden, weight, targets, ignore_index, chunk_size)


def _probe_grouped_mm() -> str | None:
    if not hasattr(torch, "_grouped_mm"):
        return "this torch has no torch._grouped_mm"
    return _probe_gpu()


def expert_mlp(x, counts, gate_up, down):
    """The experts' two projections as one grouped GEMM each (``torch._grouped_mm``, rows split at the
    cumulative counts; bf16 on sm90+: the registry's check keeps it out of other dtypes)."""
    offs = counts.to(x.device).cumsum(0).to(torch.int32)
    gate, up = torch._grouped_mm(x, gate_up.transpose(-2, -1), offs=offs).chunk(2, dim=-1)
    return torch._grouped_mm(F.silu(gate) * up, down.transpose(-2, -1), offs=offs)


for _op, _fn, _probe, _note in (
    ("rms_norm", rms_norm, _probe_triton, "triton"),
    ("apply_rotary", apply_rotary, _probe_triton, "triton"),
    ("swiglu", swiglu, _probe_triton, "triton"),
    ("attention", attention, _probe_gpu, "torch sdpa (flash)"),
    ("cross_entropy", cross_entropy, _probe_gpu, "chunked, cuBLAS"),
    ("expert_mlp", expert_mlp, _probe_grouped_mm, "torch._grouped_mm"),
):
    register(Kernel(_op, "cuda", _fn, devices=("cuda",), probe=_probe, note=_note))
