"""One block of a ring attention: its output and log-sum-exp, and its backward given the merged result.

A ring (context-parallel) attention computes this rank's queries against one K/V block at a time and merges the
partial results with their log-sum-exps (``canntrain_core.parallel.context``). Each block is the op

    out, lse = attention_block(q, k, v, causal, seg_q, seg_k, scale, tile)

q (B, Hq, Lq, D), k and v (B, Hkv, Lk, D) with Hq a multiple of Hkv (grouped-query: query head h reads K/V head
h // (Hq / Hkv)). Query i sees key j when (not ``causal`` or j <= i; a causal block is square) and (no segment ids,
or ``seg_q[b, i] == seg_k[b, j]``: packed documents). ``out`` has q's dtype, ``lse`` (B, Hq, Lq) is fp32 (fp64 for
fp64 inputs); a row that sees no key gives out 0 and lse -inf, which the merge ignores. The backward

    dq, dk, dv = kernel.backward(dout, q, k, v, out, lse, causal, seg_q, seg_k, scale, tile)

takes the MERGED out and lse of these rows (flash attention's backward: p = exp(s - lse), delta = rowsum(dout *
out)), so that each block's gradients are its exact share of the whole attention's (ring-flash-attention's and
MindSpeed's scheme); gradients come back in the inputs' dtype or wider. ``tile``: query rows per piece wherever a
backend materialises scores or masks, so they take O(tile x Lk) memory whatever Lq is.

A backend is a :class:`BlockAttention` (its forward and backward); calling it runs both under autograd (the
harness checks it that way against ``reference.attention_block``; lse carries no gradient, as in torch's flash
attention). Backends: ``eager`` here (tiled matmuls, exact in fp64), ``cpu`` (``cpu_block_attention``, torch's
fused flash attention for CPU), ``cuda`` and ``npu`` in their modules.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

DEFAULT_TILE = 256


@dataclass(frozen=True)
class BlockAttention:
    """A backend of ``attention_block``: ``forward(q, k, v, causal, seg_q, seg_k, scale, tile) -> (out, lse)`` and
    ``backward(dout, q, k, v, out, lse, causal, seg_q, seg_k, scale, tile) -> (dq, dk, dv)``."""

    forward: Callable
    backward: Callable

    def __call__(self, q, k, v, causal=True, seg_q=None, seg_k=None, scale=None, tile=DEFAULT_TILE):
        return _Block.apply(self, q, k, v, causal, seg_q, seg_k, scale, tile)


class _Block(torch.autograd.Function):
    """One block as a whole attention: the backward is given the block's own out and lse."""

    @staticmethod
    def forward(ctx, kernel, q, k, v, causal, seg_q, seg_k, scale, tile):
        out, lse = kernel.forward(q, k, v, causal, seg_q, seg_k, scale, tile)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (kernel, causal, seg_q, seg_k, scale, tile)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        kernel, causal, seg_q, seg_k, scale, tile = ctx.args
        dq, dk, dv = kernel.backward(dout, q, k, v, out, lse, causal, seg_q, seg_k, scale, tile)
        return None, dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None


# ------------------------------------------------------------------------------------------ shared parts
def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Softmax statistics in fp32, or fp64 for fp64 inputs."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def softmax_scale(q: torch.Tensor, scale: float | None) -> float:
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale


def tiles(rows: int, tile: int | None) -> list[slice]:
    """Query rows in pieces of ``tile`` (each row's attention is its own, so tiling is exact)."""
    step = rows if not tile else tile
    return [slice(i, min(i + step, rows)) for i in range(0, rows, max(step, 1))]


def check_block(q, k, causal, seg_q, seg_k) -> None:
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"attention_block: {q.shape[1]} query heads are not a multiple of {k.shape[1]} K/V heads")
    if causal and q.shape[2] != k.shape[2]:
        raise ValueError(f"attention_block: a causal block is square, got {q.shape[2]} queries x {k.shape[2]} keys")
    if (seg_q is None) != (seg_k is None):
        raise ValueError("attention_block: segment ids for both queries and keys, or for neither")


def keep_mask(causal: bool, seg_q, seg_k, rows: slice, lk: int, device) -> torch.Tensor | None:
    """The bool (B or 1, t, Lk) mask of query rows ``rows``: True where the key is seen; None: every key is."""
    keep = None
    if causal:
        i = torch.arange(rows.start, rows.stop, device=device)[:, None]
        keep = (torch.arange(lk, device=device)[None, :] <= i)[None]
    if seg_q is not None:
        same = seg_q[:, rows, None] == seg_k[:, None, :]
        keep = same if keep is None else keep & same
    return keep


def finite_lse(lse: torch.Tensor) -> torch.Tensor:
    """A row that saw no key (lse -inf) gets +inf for the backward, so that exp(s - lse) is 0 and not nan."""
    return torch.where(torch.isfinite(lse), lse, torch.inf)


# ------------------------------------------------------------------------------------------------ eager
# q viewed as (B, Hkv, G, L, D): each K/V head serves its group of query heads by broadcasting, no repeated K/V.
def _grouped(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    b, h, n, d = x.shape
    return x.reshape(b, kv_heads, h // kv_heads, n, d)


def _scores(q5, k, scale, keep):
    s = (q5 @ k.unsqueeze(2).transpose(-1, -2)) * scale
    return s if keep is None else s.masked_fill(~keep[:, None, None], float("-inf"))


def eager_forward(q, k, v, causal=True, seg_q=None, seg_k=None, scale=None, tile=DEFAULT_TILE):
    """Tiled matmuls with materialised fp32 scores, (B, Hq, tile, Lk) at a time."""
    check_block(q, k, causal, seg_q, seg_k)
    acc, scale, hkv = acc_dtype(q.dtype), softmax_scale(q, scale), k.shape[1]
    q5, kb, vb = _grouped(q, hkv).to(acc), k.to(acc), v.to(acc)
    outs, lses = [], []
    for t in tiles(q.shape[2], tile):
        s = _scores(q5[..., t, :], kb, scale, keep_mask(causal, seg_q, seg_k, t, k.shape[2], q.device))
        top = s.amax(dim=-1, keepdim=True)
        top = torch.where(torch.isfinite(top), top, 0.0)  # a row that sees nothing: exp(-inf) = 0 below, not nan
        p = torch.exp(s - top)
        total = p.sum(dim=-1, keepdim=True)
        outs.append((p @ vb.unsqueeze(2)) / torch.where(total > 0, total, 1.0))
        lses.append((top + total.log()).squeeze(-1))
    out, lse = torch.cat(outs, dim=-2), torch.cat(lses, dim=-1)
    return out.view(q.shape).to(q.dtype), lse.flatten(1, 2)


def eager_backward(dout, q, k, v, out, lse, causal=True, seg_q=None, seg_k=None, scale=None, tile=DEFAULT_TILE):
    """Flash attention's backward, tile by tile: dq per tile, dk and dv summed over the tiles (in fp32)."""
    acc, scale, hkv = lse.dtype, softmax_scale(q, scale), k.shape[1]
    q5, dout5, kb, vb = _grouped(q, hkv).to(acc), _grouped(dout, hkv).to(acc), k.to(acc), v.to(acc)
    lse5 = finite_lse(lse).view(*q5.shape[:-1])
    delta = (dout5 * _grouped(out, hkv).to(acc)).sum(dim=-1)
    dqs, dk, dv = [], 0, 0
    for t in tiles(q.shape[2], tile):
        keep = keep_mask(causal, seg_q, seg_k, t, k.shape[2], q.device)
        p = torch.exp(_scores(q5[..., t, :], kb, scale, keep) - lse5[..., t].unsqueeze(-1))
        dv = dv + (p.transpose(-1, -2) @ dout5[..., t, :]).sum(dim=2)
        ds = p * (dout5[..., t, :] @ vb.unsqueeze(2).transpose(-1, -2) - delta[..., t].unsqueeze(-1)) * scale
        dqs.append(ds @ kb.unsqueeze(2))
        dk = dk + (ds.transpose(-1, -2) @ q5[..., t, :]).sum(dim=2)
    return torch.cat(dqs, dim=-2).view(q.shape), dk, dv


eager_block_attention = BlockAttention(eager_forward, eager_backward)


# ------------------------------------------------------------------------------------------- CPU flash
# torch's fused CPU flash attention (the kernel SDPA dispatches to on a CPU) returns the log-sum-exp and has a
# backward that takes it. Needs equal head counts (K/V repeated per group, their gradients summed back); a mask is
# additive, built per query tile; a row whose keys are all masked comes back with lse 0, set to -inf here.
def _flash_ops():
    aten = torch.ops.aten
    return aten._scaled_dot_product_flash_attention_for_cpu.default, (
        aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    )


def cpu_probe() -> str | None:
    try:
        _flash_ops()
    except (AttributeError, RuntimeError) as e:
        return f"this torch has no CPU flash attention ({e})"
    return None


def _repeat_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def _additive(keep: torch.Tensor, dtype) -> torch.Tensor:
    return torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill(~keep, float("-inf"))[:, None]


def cpu_forward(q, k, v, causal=True, seg_q=None, seg_k=None, scale=None, tile=DEFAULT_TILE):
    check_block(q, k, causal, seg_q, seg_k)
    flash, _ = _flash_ops()
    acc, scale, h = acc_dtype(q.dtype), softmax_scale(q, scale), q.shape[1]
    kr, vr = _repeat_kv(k, h), _repeat_kv(v, h)
    if seg_q is None:
        out, lse = flash(q, kr, vr, 0.0, causal, scale=scale)
        return out, lse.to(acc)
    outs, lses = [], []
    for t in tiles(q.shape[2], tile):
        keep = keep_mask(causal, seg_q, seg_k, t, k.shape[2], q.device)
        out, lse = flash(q[..., t, :], kr, vr, 0.0, False, attn_mask=_additive(keep, q.dtype), scale=scale)
        outs.append(out)
        lses.append(lse.to(acc).masked_fill(~keep.any(-1)[:, None], float("-inf")))
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2)


def cpu_backward(dout, q, k, v, out, lse, causal=True, seg_q=None, seg_k=None, scale=None, tile=DEFAULT_TILE):
    _, flash_backward = _flash_ops()
    scale, h, hkv = softmax_scale(q, scale), q.shape[1], k.shape[1]
    kr, vr = _repeat_kv(k, h), _repeat_kv(v, h)
    dout, out, lse = dout.contiguous(), out.to(q.dtype), finite_lse(lse)
    if seg_q is None:
        dq, dk, dv = flash_backward(dout, q, kr, vr, out, lse, 0.0, causal, scale=scale)
    else:
        dqs, dk, dv = [], 0, 0
        for t in tiles(q.shape[2], tile):
            keep = keep_mask(causal, seg_q, seg_k, t, k.shape[2], q.device)
            parts = flash_backward(
                dout[..., t, :], q[..., t, :], kr, vr, out[..., t, :], lse[..., t].contiguous(), 0.0, False,
                attn_mask=_additive(keep, q.dtype), scale=scale,
            )  # fmt: skip
            dqs.append(parts[0])
            dk, dv = dk + parts[1].to(lse.dtype), dv + parts[2].to(lse.dtype)
        dq = torch.cat(dqs, dim=2)

    def summed(g):  # the repeated heads' gradients back onto their K/V head
        return g if hkv == h else g.unflatten(1, (hkv, h // hkv)).sum(dim=2)

    return dq, summed(dk), summed(dv)


cpu_block_attention = BlockAttention(cpu_forward, cpu_backward)
