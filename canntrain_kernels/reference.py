"""Eager reference ops: the readable definitions every backend is checked against.

Each function here is the *meaning* of an op. The ``eager`` backend is these functions
as they are; ``compile`` is ``torch.compile`` of them; ``npu`` and ``cuda`` are fused
kernels that must agree with them (``canntrain kernels check`` measures by how much).

Shapes follow transformers' Llama: q ``[B, Hq, S, D]``, k and v ``[B, Hkv, S, D]``,
cos and sin ``[B or 1, S, D]`` (each frequency written twice, "rotate-half" layout).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from canntrain_kernels.cross_entropy import chunked_cross_entropy


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """y = w * x / sqrt(mean(x^2) + eps), the statistic computed in fp32 (as transformers does)."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[x1, x2] -> [-x2, x1]: multiplies each (x1_i, x2_i) pair by i in the complex plane."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE: rotate each (x_i, x_{i+D/2}) pair of q and k by the angle of its position and frequency."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # broadcast over heads
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU activation of the Llama MLP: silu(gate) * up, silu(g) = g * sigmoid(g)."""
    return F.silu(gate) * up


def expert_mlp(x: torch.Tensor, counts: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """A mixture of experts' SwiGLU experts on rows grouped by expert: ``counts[e]`` rows of ``x`` [rows, hidden]
    for expert e, whose weights are ``gate_up[e]`` [2 x intermediate, hidden] (gate rows, then up rows) and
    ``down[e]`` [hidden, intermediate], as transformers stores them. A loop over the experts."""
    outs = []
    for e, rows in enumerate(x.split(counts.tolist())):
        gate, up = F.linear(rows, gate_up[e]).chunk(2, dim=-1)
        outs.append(F.linear(F.silu(gate) * up, down[e]))
    return torch.cat(outs)


def attention_mask(s_q: int, s_k: int, causal: bool = True, window: int | None = None, device=None) -> torch.Tensor:
    """Boolean [s_q, s_k] mask, True where query i may attend key j (queries aligned to the end)."""
    i = torch.arange(s_q, device=device)[:, None] + (s_k - s_q)
    j = torch.arange(s_k, device=device)[None, :]
    keep = torch.ones(s_q, s_k, dtype=torch.bool, device=device)
    if causal:
        keep &= j <= i
    if window is not None:
        keep &= j > i - window
    return keep


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = True,
    window: int | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v with grouped-query heads; returns [B, Hq, S, D].

    Each group of Hq/Hkv query heads shares one key/value head. ``window=W`` keeps only the
    W most recent keys (sliding-window attention). The softmax runs in fp32.
    """
    hq, hkv = q.shape[1], k.shape[1]
    if hq % hkv:
        raise ValueError(f"attention: {hq} query heads is not a multiple of {hkv} key/value heads")
    if window is not None and window < 1:
        raise ValueError(f"attention: window must be >= 1, got {window}")
    k = k.repeat_interleave(hq // hkv, dim=1)
    v = v.repeat_interleave(hq // hkv, dim=1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = (q @ k.transpose(-2, -1)) * scale
    keep = attention_mask(q.shape[-2], k.shape[-2], causal, window, device=q.device)
    scores = scores.masked_fill(~keep, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return probs @ v


def plain_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100
) -> torch.Tensor:
    """Mean of -log softmax(hidden @ weight^T)[target]; builds all [N, V] logits in fp32 at once."""
    logits = hidden @ weight.t()
    acc = torch.promote_types(logits.dtype, torch.float32)  # fp32, or fp64 for fp64 inputs
    return F.cross_entropy(logits.to(acc), targets, ignore_index=ignore_index)


def cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int = -100,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """The same mean loss as :func:`plain_cross_entropy`, computed ``chunk_size`` rows at a time.

    Forward and backward never hold more than one chunk of fp32 logits (see kernels.cross_entropy).
    """
    return chunked_cross_entropy(hidden, weight, targets, ignore_index=ignore_index, chunk_size=chunk_size)


def attention_block(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = True,
    seg_q: torch.Tensor | None = None,
    seg_k: torch.Tensor | None = None,
    scale: float | None = None,
    tile: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One block of a ring attention (``canntrain_kernels.block_attention``): softmax(q k^T * scale) v over the
    keys each query sees (j <= i when ``causal``; the same segment id when given), and the log-sum-exp of each
    row's scores (no gradient; -inf where a row sees no key, whose output is 0). ``tile`` is a memory bound, not a
    meaning."""
    hq, hkv = q.shape[1], k.shape[1]
    k, v = k.repeat_interleave(hq // hkv, dim=1), v.repeat_interleave(hq // hkv, dim=1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = (q @ k.transpose(-2, -1)).to(torch.promote_types(q.dtype, torch.float32)) * scale
    keep = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device)[None]
    if causal:
        keep = keep & attention_mask(q.shape[-2], k.shape[-2], True, device=q.device)
    if seg_q is not None:
        keep = keep & (seg_q[:, :, None] == seg_k[:, None, :])
    scores = scores.masked_fill(~keep[:, None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - torch.where(torch.isfinite(lse), lse, 0.0).unsqueeze(-1))
    return (probs @ v.to(probs.dtype)).to(q.dtype), lse.detach()
