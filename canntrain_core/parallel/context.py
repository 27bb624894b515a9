"""Context parallelism's attention: each rank of a ``cp`` group holds a slice of every sequence, and attention
over the whole sequence is computed exactly, causal with respect to GLOBAL positions.

The layout (load-balanced, as torch's ``_HeadTailLoadBalancer`` and Megatron's zigzag): a sequence of S tokens
is cut into 2 x cp chunks of c = S / (2 cp) tokens; rank i holds chunk i then chunk 2 cp - 1 - i (``split``),
so under a causal mask every rank has the same amount of work. ``unsplit`` puts the ranks' slices back in
order, ``positions`` gives a rank's tokens' global positions (RoPE and the loss must use them).

Two attentions over that layout, q/k/v shaped (batch, heads, 2c, head_dim), k/v possibly with fewer heads
(grouped-query: query head h reads kv head h // (heads / kv_heads), as transformers' ``repeat_kv``):

- ``ring_attention``: K/V circulate around the ring (point-to-point ``batch_isend_irecv``, which gloo runs as
  separate isend/irecv; HCCL and NCCL coalesce) over cp - 1 steps, the next block's transfer overlapping the
  current block's compute. Each block gives a partial output and its log-sum-exp; they are merged with the LSE
  correction in fp32 (fp64 for fp64 inputs). Thanks to the layout a block off the diagonal needs no mask: from
  a lower rank, all of this rank's queries see the sender's head chunk only; from a higher rank, only this rank's
  tail chunk sees it, all of it (half the block's work either way). The backward is explicit (ring-flash-
  attention's): K/V circulate again, each block's attention is recomputed from the saved LSE, and the dK/dV
  accumulators travel the ring with them, cp hops, back to their owner.
  Kept for backward per rank: q, k, v, out (input dtype) and the LSE (fp32), i.e. O(S / cp) -- nothing of
  size S or S^2. Transient: one block's scores, (batch, heads, 2c, 2c) in fp32, and one K/V block in flight.
  Sent per rank per training step: 2 (cp - 1) K/V blocks (forward and backward) and cp dK/dV blocks (fp32).
- ``allgather_attention``: K/V all-gathered once, then one masked ``F.scaled_dot_product_attention`` of this
  rank's queries over the whole sequence; its backward reduce-scatters dK/dV. Simpler; received per rank per
  step: cp - 1 K/V blocks (forward), cp - 1 dK/dV blocks sent (backward). But it keeps the full sequence's
  K/V for backward (O(S) per rank) and builds a (2c, S) mask, and computes every masked-out score (about twice
  the ring's work).

Measured (``benchmarks/cp_attention.py``, 2 shared CPU cores, fp32, 8 query / 2 kv heads of 64, S = 4096,
cp = 2): all-gather 1.5 s forward+backward, ring 2.7 s (its blocks are unfused matmuls with materialised scores,
the all-gather's one call is SDPA's fused CPU kernel); kept for backward per rank, ring 10 MiB, all-gather 44 MiB.
On an accelerator the ring's blocks should call the device's fused attention that returns the LSE.

Both take an optional ``segment_ids`` (batch, 2c), split like the tokens: a token then attends only to earlier
tokens of the same document (packed rows). The ids are all-gathered once (integers, no gradient).

Measured on torch 2.13 (CPU build, gloo, 2 processes; ``benchmarks/cp_attention.py --probe-torch``): torch's own
``torch.distributed.tensor.experimental.context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2])``
does not run on CPU. ``F.scaled_dot_product_attention(q, k, v, is_causal=True)`` inside it fails in fp32 and
fp64, forward alone or with backward, with "NotImplementedError: Operator
aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding strategy registered." (its ring
handles only the CUDA flash / efficient / cuDNN SDPA ops); forcing the math backend
(``sdpa_kernel([SDPBackend.MATH])``) fails with "RuntimeError: aten.add.Tensor got mixed torch.Tensor and DTensor"
(the causal mask is a plain tensor). ``_set_cp_dispatcher`` does not exist in 2.13. Hence this module: plain
torch, any backend with point-to-point ops, exact in fp64 (tests/parallel/test_context_parallel.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F


# ---------------------------------------------------------------------------------------------- the layout
def chunks_of(rank: int, cp: int) -> tuple[int, int]:
    """The two chunks (of 2 x cp) that ``rank`` holds: its head and its mirror from the tail."""
    return rank, 2 * cp - 1 - rank


def _chunk_len(seq_len: int, cp: int) -> int:
    if seq_len % (2 * cp):
        raise ValueError(f"context parallel: sequence length {seq_len} is not divisible by 2 x cp = {2 * cp}")
    return seq_len // (2 * cp)


def split(x: torch.Tensor, cp: int, rank: int, dim: int) -> torch.Tensor:
    """This rank's slice of a whole sequence along ``dim``: chunk ``rank`` then chunk ``2 cp - 1 - rank``."""
    c = _chunk_len(x.shape[dim], cp)
    head, tail = chunks_of(rank, cp)
    return torch.cat([x.narrow(dim, head * c, c), x.narrow(dim, tail * c, c)], dim=dim)


def unsplit(shards: Sequence[torch.Tensor], dim: int) -> torch.Tensor:
    """The whole sequence from every rank's slice (in rank order): the inverse of ``split``."""
    cp = len(shards)
    halves = [shard.chunk(2, dim=dim) for shard in shards]
    ordered = [halves[i][0] for i in range(cp)] + [halves[i][1] for i in reversed(range(cp))]
    return torch.cat(ordered, dim=dim)


def positions(seq_len: int, cp: int, rank: int, device: torch.device | str | None = None) -> torch.Tensor:
    """The global positions (int64) of this rank's tokens, in its layout."""
    return split(torch.arange(seq_len, device=device), cp, rank, dim=0)


def gather_sequence(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """Every rank's slice all-gathered and put back in order along ``dim`` (no gradient: for checks and metrics)."""
    shards = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(shards, x.contiguous(), group=group)
    return unsplit(shards, dim)


def _all_segment_ids(segment_ids: torch.Tensor | None, group) -> torch.Tensor | None:
    """Every rank's (batch, 2c) segment ids, stacked in rank order: (cp, batch, 2c)."""
    if segment_ids is None:
        return None
    return _gather(segment_ids, group)


def _gather(x: torch.Tensor, group) -> torch.Tensor:
    """All-gather along a new leading rank dimension (flat buffers: gloo takes no stacked output shape)."""
    out = x.new_empty(dist.get_world_size(group) * x.numel())
    dist.all_gather_single(out, x.reshape(-1), group=group)
    return out.view(-1, *x.shape)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Softmax statistics and merges in fp32, or fp64 for fp64 inputs."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _scale(q: torch.Tensor, scale: float | None) -> float:
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale


# -------------------------------------------------------------------------------- one block of attention
# q is viewed as (batch, kv_heads, group, L, D) so that each kv head serves its group of query heads by
# broadcasting, with no repeated K/V in memory. A mask is a bool tensor broadcastable to (B, 1, 1, Lq, Lk).


def _grouped(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    b, h, n, d = q.shape
    if h % kv_heads:
        raise ValueError(f"context parallel: {h} query heads are not a multiple of {kv_heads} key/value heads")
    return q.view(b, kv_heads, h // kv_heads, n, d)


def _scores(q5: torch.Tensor, k: torch.Tensor, scale: float, mask: torch.Tensor | None) -> torch.Tensor:
    s = (q5 @ k.unsqueeze(2).transpose(-1, -2)) * scale
    return s if mask is None else s.masked_fill(~mask, float("-inf"))


def _block_forward(q5, k, v, scale, mask):
    """A block's softmax(q k^T) v and its log-sum-exp; rows that see no key give output 0 and LSE -inf."""
    s = _scores(q5, k, scale, mask)
    top = s.amax(dim=-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, 0.0)  # a fully masked row: exp(-inf) = 0 below, not nan
    p = torch.exp(s - top)
    total = p.sum(dim=-1, keepdim=True)
    out = (p @ v.unsqueeze(2)) / torch.where(total > 0, total, 1.0)
    return out, (top + total.log()).squeeze(-1)


def _block_backward(q5, k, v, dout5, lse, delta, scale, mask):
    """Gradients of one block given the final LSE and delta = rowsum(dout * out) (flash attention's backward)."""
    p = torch.exp(_scores(q5, k, scale, mask) - lse.unsqueeze(-1))
    dv = (p.transpose(-1, -2) @ dout5).sum(dim=2)
    ds = p * (dout5 @ v.unsqueeze(2).transpose(-1, -2) - delta.unsqueeze(-1)) * scale
    return ds @ k.unsqueeze(2), (ds.transpose(-1, -2) @ q5).sum(dim=2), dv


def _merge(out, lse, rows, block_out, block_lse) -> None:
    """Fold a block's partial result into the running (out, lse) of ``rows``, in place (lse stays finite: the
    diagonal block comes first and every token sees itself)."""
    old = lse[..., rows]
    new = torch.logaddexp(old, block_lse)
    out[..., rows, :] = out[..., rows, :] * torch.exp(old - new).unsqueeze(-1) + block_out * torch.exp(
        block_lse - new
    ).unsqueeze(-1)
    lse[..., rows] = new


def _block(kv, rank: int, src: int, c: int, pos, segs, acc):
    """This rank's query rows that see ``src``'s K/V, the key columns they see, the mask, and that K/V block."""
    rows, cols, causal = _plan(rank, src, c)
    mask = _mask(rows, cols, causal, pos, None if segs is None else segs[rank], None if segs is None else segs[src])
    return rows, cols, mask, kv[0, :, :, cols].to(acc), kv[1, :, :, cols].to(acc)


def _plan(rank: int, src: int, c: int) -> tuple[slice, slice, bool]:
    """Which of this rank's query rows see which of ``src``'s key columns, and whether a causal mask is needed.

    Chunks a < b: every query of b sees every key of a. From a lower rank, this rank's head (chunk rank) and tail
    (2 cp - 1 - rank) both come after the sender's head and before its tail; from a higher rank, this rank's head
    precedes both of the sender's chunks and its tail follows both."""
    if src == rank:
        return slice(None), slice(None), True
    if src < rank:
        return slice(None), slice(0, c), False
    return slice(c, None), slice(None), False


def _mask(rows, cols, causal, pos, seg_q, seg_k):
    """The (B, 1, 1, Lq, Lk) bool mask of a block, or None where it sees everything."""
    mask = None
    if causal:
        mask = (pos[rows, None] >= pos[None, cols])[None, None, None]
    if seg_q is not None:
        same = (seg_q[:, rows, None] == seg_k[:, None, cols])[:, None, None]
        mask = same if mask is None else mask & same
    return mask


# ------------------------------------------------------------------------------------------------ the ring
def _shift(t: torch.Tensor, group, rank: int, cp: int, tag: int = 0):
    """Start sending ``t`` to the next rank and receiving the previous rank's; returns (buffer, works, t): ``t``
    stays referenced until the works are waited on. ``tag`` keeps K/V and dK/dV, in flight together between the
    same ranks, apart."""
    recv = torch.empty_like(t)
    ops = [
        dist.P2POp(dist.isend, t, group=group, tag=tag, group_peer=(rank + 1) % cp),
        dist.P2POp(dist.irecv, recv, group=group, tag=tag, group_peer=(rank - 1) % cp),
    ]
    return recv, dist.batch_isend_irecv(ops), t


def _wait(works) -> None:
    for work in works:
        work.wait()


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, scale, segs):
        rank, cp = dist.get_rank(group), dist.get_world_size(group)
        c, acc = q.shape[2] // 2, _acc_dtype(q.dtype)
        pos = positions(2 * cp * c, cp, rank, q.device)
        q5 = _grouped(q, k.shape[1]).to(acc)
        kv = torch.stack([k, v]).contiguous()  # one message per hop
        out = lse = None
        for step in range(cp):
            src = (rank - step) % cp
            pending = _shift(kv, group, rank, cp) if step < cp - 1 else None
            rows, _, mask, kb, vb = _block(kv, rank, src, c, pos, segs, acc)
            block_out, block_lse = _block_forward(q5[..., rows, :], kb, vb, scale, mask)
            if out is None:  # the diagonal: every row
                out, lse = block_out, block_lse
            else:
                _merge(out, lse, rows, block_out, block_lse)
            if pending is not None:
                _wait(pending[1])
                kv = pending[0]
        out = out.view(q.shape).to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, segs)
        ctx.group, ctx.scale = group, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, segs = ctx.saved_tensors
        group, scale = ctx.group, ctx.scale
        rank, cp = dist.get_rank(group), dist.get_world_size(group)
        c, acc, kv_heads = q.shape[2] // 2, lse.dtype, k.shape[1]
        pos = positions(2 * cp * c, cp, rank, q.device)
        q5 = _grouped(q, kv_heads).to(acc)
        dout5 = _grouped(dout.contiguous(), kv_heads).to(acc)
        delta = (dout5 * _grouped(out, kv_heads).to(acc)).sum(dim=-1)
        dq5 = torch.zeros_like(q5)
        kv = torch.stack([k, v]).contiguous()
        traveling = None  # the dK/dV accumulator of this step's K/V, on its way from the previous rank
        for step in range(cp):
            src = (rank - step) % cp
            pending = _shift(kv, group, rank, cp) if step < cp - 1 else None
            rows, cols, mask, kb, vb = _block(kv, rank, src, c, pos, segs, acc)
            dq_b, dk_b, dv_b = _block_backward(
                q5[..., rows, :], kb, vb, dout5[..., rows, :], lse[..., rows], delta[..., rows], scale, mask
            )
            dq5[..., rows, :] += dq_b
            if traveling is None:
                dkv = torch.zeros(kv.shape, dtype=acc, device=kv.device)
            else:
                _wait(traveling[1])
                dkv = traveling[0]
            dkv[0, :, :, cols] += dk_b
            dkv[1, :, :, cols] += dv_b
            traveling = _shift(dkv, group, rank, cp, tag=1) if cp > 1 else (dkv, [], dkv)
            if pending is not None:
                _wait(pending[1])
                kv = pending[0]
        _wait(traveling[1])  # after cp hops, this rank's own K/V's gradient
        dkv = traveling[0]
        return dq5.view(q.shape).to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None


def ring_attention(q, k, v, group=None, *, scale: float | None = None, segment_ids: torch.Tensor | None = None):
    """Causal attention of this rank's q/k/v (batch, heads, 2c, head_dim; k/v with heads or fewer) over the
    whole sequence split over ``group`` (None: the default group), K/V passed around the ring. ``scale``: the
    softmax scale, 1 / sqrt(head_dim) by default. ``segment_ids`` (batch, 2c), split like the tokens: attend
    within one's document only. Returns this rank's output, shaped and typed like q."""
    segs = _all_segment_ids(segment_ids, group)
    return _RingAttention.apply(q, k, v, group, _scale(q, scale), segs)


# ------------------------------------------------------------------------------------------- all-gather
class _AllGather(torch.autograd.Function):
    """All-gather along a new leading rank dimension; the backward reduce-scatters (sums) the gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather(x, group)

    @staticmethod
    def backward(ctx, grad):
        back = grad.new_empty(grad[0].numel())
        dist.reduce_scatter_single(back, grad.reshape(-1), group=ctx.group)
        return back.view(grad.shape[1:]), None


def allgather_attention(
    q, k, v, group=None, *, scale: float | None = None, segment_ids: torch.Tensor | None = None
) -> torch.Tensor:
    """``ring_attention``'s result, by all-gathering K/V and attending over the whole sequence with a mask on
    global positions (the keys stay in rank order: the mask, not their order, carries causality)."""
    rank, cp = dist.get_rank(group), dist.get_world_size(group)
    seq_len = cp * q.shape[2]
    kv = _AllGather.apply(torch.stack([k, v]), group)  # (cp, 2, B, H_kv, 2c, D)
    keys, values = (kv[:, i].permute(1, 2, 0, 3, 4).flatten(2, 3) for i in range(2))  # (B, H_kv, S, D)
    k_pos = torch.cat([positions(seq_len, cp, r, q.device) for r in range(cp)])
    mask = (positions(seq_len, cp, rank, q.device)[:, None] >= k_pos[None, :])[None, None]
    segs = _all_segment_ids(segment_ids, group)
    if segs is not None:
        all_segs = segs.permute(1, 0, 2).flatten(1)  # (B, S), rank order like the keys
        mask = mask & (segment_ids[:, :, None] == all_segs[:, None, :])[:, None]
    return F.scaled_dot_product_attention(
        q, keys, values, attn_mask=mask, scale=_scale(q, scale), enable_gqa=k.shape[1] != q.shape[1]
    )
