"""The npu backend: Ascend fused operators from torch_npu (CANN), each with its own backward.

Signatures (torch_npu / op-plugin documentation):

* ``torch_npu.npu_rms_norm(x, gamma, epsilon=1e-6) -> (y, rstd)``; gamma has x's dtype.
* ``torch_npu.npu_rotary_mul(x, r1, r2, rotary_mode='half') -> y``: y = x*r1 + rotate_half(x)*r2,
  x in BNSD with r1/r2 broadcastable as [B or 1, 1, S, D].
* ``torch_npu.npu_swiglu(x, dim=-1) -> y``: x = [A, B] halves along dim, y = silu(A) * B.
* ``torch_npu.npu_grouped_matmul(x, weight, *, group_list, split_item, group_type, group_list_type) -> [y]``:
  with ``split_item=3`` one x [m, k] and one weight [groups, k, n] give one y [m, n]; ``group_type=0`` splits m,
  ``group_list_type=1`` gives rows per group (MindSpeed's gmm for a mixture of experts).
* ``torch_npu.npu_fusion_attention(q, k, v, head_num, input_layout, pse=None, padding_mask=None,
  atten_mask=None, scale=1., keep_prob=1., pre_tockens=2147483647, next_tockens=2147483647,
  inner_precise=0, prefix=None, actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode=0, ...)
  -> (out, softmax_max, softmax_sum, softmax_in, seed, offset, numels)``. atten_mask is True where
  masked; sparse_mode 3 (right-down causal) and 4 (band, keeps i-pre <= j <= i+next) take the
  compressed 2048x2048 upper-triangular mask. GQA: Hq must be a multiple of Hkv. softmax_max and softmax_sum
  are (B, N, S, 8) fp32, the row's statistic repeated 8 times: its log-sum-exp is max + log(sum).
* ``torch_npu.npu_fusion_attention_grad(q, k, v, dy, head_num, input_layout, *, atten_mask=None,
  softmax_max=None, softmax_sum=None, softmax_in=None, attention_in=None, scale_value=1., keep_prob=1., ...,
  sparse_mode=0) -> (dq, dk, dv, dpse)``. Given a merged result's max = lse and sum = 1 with the merged output
  as attention_in, it gives one ring block's share of the gradients (MindSpeed's ring attention does this).

torch_npu is imported on first use only; on a machine without it every kernel here is
unavailable with the reason, and the registry never selects them.
"""

from __future__ import annotations

import functools
import importlib

import torch

from canntrain_kernels import reference
from canntrain_kernels.block_attention import (
    DEFAULT_TILE,
    BlockAttention,
    check_block,
    finite_lse,
    keep_mask,
    softmax_scale,
    tiles,
)
from canntrain_kernels.cross_entropy import chunked_cross_entropy
from canntrain_kernels.registry import Kernel, register


@functools.lru_cache(maxsize=1)
def _torch_npu():
    return importlib.import_module("torch_npu")


def _probe() -> str | None:
    try:
        _torch_npu()
    except Exception as e:  # ImportError, or CANN libraries missing at load time
        return f"torch_npu is not importable ({type(e).__name__}: {e})"
    if not (hasattr(torch, "npu") and torch.npu.is_available()):
        return "torch_npu imported but no NPU is visible"
    return None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """RMSNorm by npu_rms_norm; the weight is cast to x's dtype as the op requires."""
    y, _rstd = _torch_npu().npu_rms_norm(x, weight.to(x.dtype), epsilon=eps)
    out_dtype = torch.promote_types(x.dtype, weight.dtype)
    return y.to(out_dtype)


def apply_rotary(q, k, cos, sin):
    """RoPE on q and k (BNSD) by npu_rotary_mul in 'half' mode, cos/sin broadcast over heads."""
    npu = _torch_npu()
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return npu.npu_rotary_mul(q, cos.to(q.dtype), sin.to(q.dtype)), npu.npu_rotary_mul(
        k, cos.to(k.dtype), sin.to(k.dtype)
    )


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up by npu_swiglu on the packed [gate, up] tensor."""
    return _torch_npu().npu_swiglu(torch.cat((gate, up), dim=-1), dim=-1)


@functools.lru_cache(maxsize=8)
def _compressed_causal_mask(device: str) -> torch.Tensor:
    return torch.triu(torch.ones(2048, 2048, dtype=torch.bool, device=device), diagonal=1)


def attention(q, k, v, causal: bool = True, window: int | None = None, scale: float | None = None):
    """Flash attention by npu_fusion_attention in BNSD layout, GQA native."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    kwargs = dict(scale=scale, keep_prob=1.0)
    if causal and window is None:
        kwargs.update(atten_mask=_compressed_causal_mask(str(q.device)), sparse_mode=3)
    elif causal:
        # Band: key j is kept for query i when i - (window - 1) <= j <= i.
        kwargs.update(
            atten_mask=_compressed_causal_mask(str(q.device)),
            sparse_mode=4,
            pre_tockens=window - 1,
            next_tockens=0,
        )
    elif window is not None:
        keep = reference.attention_mask(q.shape[-2], k.shape[-2], False, window, device=q.device)
        kwargs.update(atten_mask=~keep, sparse_mode=0)
    out = _torch_npu().npu_fusion_attention(q, k, v, q.shape[1], "BNSD", **kwargs)
    return out[0]


def _block_masks(q, k, causal, seg_q, seg_k, tile):
    """(query rows, npu_fusion_attention's mask arguments, keep mask or None) for each piece of a ring block: the
    whole block with the compressed causal mask (or none), or tiles of rows with their document mask (True where
    masked), so a packed block's mask takes (B, tile, Lk) bytes."""
    if seg_q is None:
        masks = dict(atten_mask=_compressed_causal_mask(str(q.device)), sparse_mode=3) if causal else {}
        return [(slice(0, q.shape[2]), masks, None)]
    pieces = []
    for t in tiles(q.shape[2], tile):
        keep = keep_mask(causal, seg_q, seg_k, t, k.shape[2], q.device)
        pieces.append((t, dict(atten_mask=~keep[:, None], sparse_mode=0), keep))
    return pieces


def block_forward(q, k, v, causal=True, seg_q=None, seg_k=None, scale=None, tile=DEFAULT_TILE):
    """A ring block by npu_fusion_attention; lse = softmax_max + log(softmax_sum); rows that see no key: 0, -inf."""
    check_block(q, k, causal, seg_q, seg_k)
    outs, lses = [], []
    for rows, masks, keep in _block_masks(q, k, causal, seg_q, seg_k, tile):
        out, smax, ssum, *_ = _torch_npu().npu_fusion_attention(
            q[..., rows, :], k, v, q.shape[1], "BNSD", scale=softmax_scale(q, scale), keep_prob=1.0, **masks
        )
        lse = smax[..., 0].float() + ssum[..., 0].float().log()
        if keep is not None:
            seen = keep.any(-1)[:, None]
            lse, out = lse.masked_fill(~seen, float("-inf")), out.masked_fill(~seen[..., None], 0.0)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2)


def block_backward(dout, q, k, v, out, lse, causal=True, seg_q=None, seg_k=None, scale=None, tile=DEFAULT_TILE):
    """A ring block's gradients by npu_fusion_attention_grad from the merged output and lse (max = lse, sum = 1)."""
    stat = finite_lse(lse).float().unsqueeze(-1).expand(*lse.shape, 8).contiguous()
    ones, out, dq, dk, dv = torch.ones_like(stat), out.to(q.dtype), [], 0, 0
    for rows, masks, _ in _block_masks(q, k, causal, seg_q, seg_k, tile):
        grads = _torch_npu().npu_fusion_attention_grad(
            q[..., rows, :], k, v, dout[..., rows, :].contiguous(), q.shape[1], "BNSD",
            softmax_max=stat[..., rows, :].contiguous(), softmax_sum=ones[..., rows, :].contiguous(),
            attention_in=out[..., rows, :].contiguous(), scale_value=softmax_scale(q, scale), keep_prob=1.0, **masks,
        )  # fmt: skip
        dq.append(grads[0])
        dk, dv = dk + grads[1].float(), dv + grads[2].float()
    return torch.cat(dq, dim=2), dk, dv


def cross_entropy(hidden, weight, targets, ignore_index: int = -100, chunk_size: int | None = None):
    """The chunked cross-entropy of the reference (matmul + logsumexp per chunk run as CANN ops)."""
    return chunked_cross_entropy(hidden, weight, targets, ignore_index, chunk_size)


def expert_mlp(x, counts, gate_up, down):
    """The experts' projections as grouped matmuls (npu_grouped_matmul), the activation by npu_swiglu. Written
    against torch_npu's documented API and not run here: the registry's numerics check, forward and backward,
    decides whether auto uses it."""
    npu = _torch_npu()
    groups = counts.to(device=x.device, dtype=torch.int64)

    def grouped(a, w):  # a [rows, k] by each expert's w [n, k] (transformers' layout): a_e @ w_e^T
        return npu.npu_grouped_matmul(
            [a], [w.transpose(-2, -1)], group_list=groups, split_item=3, group_type=0, group_list_type=1
        )[0]

    return grouped(npu.npu_swiglu(grouped(x, gate_up), dim=-1), down)


for _op, _fn in {
    "rms_norm": rms_norm,
    "apply_rotary": apply_rotary,
    "swiglu": swiglu,
    "attention": attention,
    "cross_entropy": cross_entropy,
    "expert_mlp": expert_mlp,
    "attention_block": BlockAttention(block_forward, block_backward),
}.items():
    register(Kernel(_op, "npu", _fn, devices=("npu",), probe=_probe, note="torch_npu"))
