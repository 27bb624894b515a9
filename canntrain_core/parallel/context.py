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
  current block's compute. Each block is the kernel registry's ``attention_block`` (canntrain_kernels.
  block_attention): its partial output and log-sum-exp, merged here with the LSE correction in fp32 (fp64 for fp64
  inputs). Thanks to the layout a block off the diagonal needs no causal mask: from a lower rank, all of this
  rank's queries see the sender's head chunk only; from a higher rank, only this rank's tail chunk sees it, all of
  it (half the block's work either way); the diagonal block is the plain lower triangle (a rank's positions
  increase along its slice). The backward is explicit (ring-flash-attention's): K/V circulate again, each block's
  gradients come from the block's backward given the MERGED output and LSE, and the dK/dV accumulators travel the
  ring with them, cp hops, back to their owner.
  Kept for backward per rank: q, k, v, out (input dtype) and the LSE (fp32), i.e. O(S / cp) -- nothing of
  size S or S^2. Transient: one block's work (the eager blocks: (batch, heads, 256, 2c) fp32 scores a tile), one
  K/V block in flight. Sent per rank per training step: 2 (cp - 1) K/V blocks (forward and backward) and cp
  dK/dV blocks (fp32).
- ``allgather_attention``: K/V all-gathered once, then one masked ``F.scaled_dot_product_attention`` of this
  rank's queries over the whole sequence; its backward reduce-scatters dK/dV. Simpler; received per rank per
  step: cp - 1 K/V blocks (forward), cp - 1 dK/dV blocks sent (backward). But it keeps the full sequence's
  K/V for backward (O(S) per rank) and builds a (2c, S) mask, and computes every masked-out score (about twice
  the ring's work).

Measured (``benchmarks/cp_attention.py --cp 2 --seq 4096``, 2 shared CPU cores, fp32, 8 query / 2 kv heads of 64,
medians of 3): forward+backward per rank, the ring on the ``cpu`` blocks (torch's flash attention for CPU) 451 ms,
on the ``eager`` blocks (tiled matmuls) 1360 ms, all-gather 914 ms; one process's SDPA over the whole row 884 ms.
Kept for backward per rank: ring 10 MiB, all-gather 44 MiB. Hence the ring, on the device's fused block where the
registry has one (``model.kernels: auto``; the ``npu`` block is ``npu_fusion_attention``, not run here; CUDA has
none yet and runs the eager blocks).

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
torch, any backend with point-to-point ops, exact in fp64 (tests/parallel/test_context_parallel.py). It also does
what torch's does not: packed rows' document masks, and pipeline stages (``ContextParallel.pipelined``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import eager_attention_forward

from canntrain_core.errors import RecipeError
from canntrain_core.families.family import layer_windows
from canntrain_core.sizing.activations import RING_QUERY_TILE
from canntrain_kernels.block_attention import BlockAttention, acc_dtype, eager_block_attention, softmax_scale


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


# -------------------------------------------------------------------------------- one block of attention
# A block is the kernel registry's ``attention_block`` (canntrain_kernels.block_attention): the device's fused
# attention returning its log-sum-exp where there is one, tiled matmuls otherwise.


def _merge(out, lse, rows, block_out, block_lse) -> None:
    """Fold a block's partial result into the running (out, lse) of ``rows``, in place (lse stays finite: the
    diagonal block comes first and every token sees itself)."""
    old = lse[..., rows]
    new = torch.logaddexp(old, block_lse)
    out[..., rows, :] = out[..., rows, :] * torch.exp(old - new).unsqueeze(-1) + block_out * torch.exp(
        block_lse - new
    ).unsqueeze(-1)
    lse[..., rows] = new


def _block(kv, rank: int, src: int, c: int, segs):
    """This rank's query rows that see ``src``'s K/V, the key columns they see, whether the block is causal (the
    diagonal: in a rank's layout positions increase, so the mask is the plain lower triangle), both sides' segment
    ids, and that K/V block."""
    rows, cols, causal = _plan(rank, src, c)
    seg_q = None if segs is None else segs[rank][:, rows]
    seg_k = None if segs is None else segs[src][:, cols]
    return rows, cols, causal, seg_q, seg_k, kv[0, :, :, cols], kv[1, :, :, cols]


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


def ring_steps(cp: int) -> list[list[str]]:
    """What each rank computes at each ring step, in words (``[step][rank]``): whose K/V it holds and which of its
    query chunks see which of that rank's key chunks. Every rank does the same work at every step."""
    steps = []
    for step in range(cp):
        row = []
        for rank in range(cp):
            src = (rank - step) % cp
            head, tail = chunks_of(rank, cp)
            s_head, s_tail = chunks_of(src, cp)
            if src == rank:
                row.append(f"own K/V: chunks {head},{tail} x {s_head},{s_tail} causal")
            elif src < rank:
                row.append(f"rank {src}'s K/V: chunks {head},{tail} x {s_head}")
            else:
                row.append(f"rank {src}'s K/V: chunk {tail} x {s_head},{s_tail}")
        steps.append(row)
    return steps


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
    def forward(ctx, q, k, v, group, scale, segs, block):
        rank, cp = dist.get_rank(group), dist.get_world_size(group)
        c, acc = q.shape[2] // 2, acc_dtype(q.dtype)
        kv = torch.stack([k, v]).contiguous()  # one message per hop
        out = lse = None
        for step in range(cp):
            src = (rank - step) % cp
            pending = _shift(kv, group, rank, cp) if step < cp - 1 else None
            rows, _, causal, seg_q, seg_k, kb, vb = _block(kv, rank, src, c, segs)
            block_out, block_lse = block.forward(q[..., rows, :], kb, vb, causal, seg_q, seg_k, scale, RING_QUERY_TILE)
            if out is None:  # the diagonal: every row
                out, lse = block_out.to(acc), block_lse
            else:
                _merge(out, lse, rows, block_out.to(acc), block_lse)
            if pending is not None:
                _wait(pending[1])
                kv = pending[0]
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, segs)
        ctx.group, ctx.scale, ctx.block = group, scale, block
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, segs = ctx.saved_tensors
        group, scale, block = ctx.group, ctx.scale, ctx.block
        rank, cp = dist.get_rank(group), dist.get_world_size(group)
        c, acc = q.shape[2] // 2, lse.dtype
        dout = dout.contiguous()
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        kv = torch.stack([k, v]).contiguous()
        traveling = None  # the dK/dV accumulator of this step's K/V, on its way from the previous rank
        for step in range(cp):
            src = (rank - step) % cp
            pending = _shift(kv, group, rank, cp) if step < cp - 1 else None
            rows, cols, causal, seg_q, seg_k, kb, vb = _block(kv, rank, src, c, segs)
            dq_b, dk_b, dv_b = block.backward(
                dout[..., rows, :], q[..., rows, :], kb, vb, out[..., rows, :], lse[..., rows],
                causal, seg_q, seg_k, scale, RING_QUERY_TILE,
            )  # fmt: skip
            dq[..., rows, :] += dq_b
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
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None


def ring_attention(
    q,
    k,
    v,
    group=None,
    *,
    scale: float | None = None,
    segment_ids: torch.Tensor | None = None,
    block: BlockAttention = eager_block_attention,
):
    """Causal attention of this rank's q/k/v (batch, heads, 2c, head_dim; k/v with heads or fewer) over the
    whole sequence split over ``group`` (None: the default group), K/V passed around the ring. ``scale``: the
    softmax scale, 1 / sqrt(head_dim) by default. ``segment_ids`` (batch, 2c), split like the tokens: attend
    within one's document only. ``block``: the kernel registry's ``attention_block`` backend each block runs on.
    Returns this rank's output, shaped and typed like q."""
    segs = _all_segment_ids(segment_ids, group)
    return _RingAttention.apply(q, k, v, group, softmax_scale(q, scale), segs, block)


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
        q, keys, values, attn_mask=mask, scale=softmax_scale(q, scale), enable_gqa=k.shape[1] != q.shape[1]
    )


# ------------------------------------------------------------------------------------------ in the model
ATTENTION_NAME = "canntrain_context_parallel"  # transformers' attention interface key


class ContextParallel:
    """A model's context parallelism: its cp group, and for the forward under way whether its inputs are this
    rank's slices (``active``, set by ``CausalLM.forward``) and every rank's segment ids. Inactive (generation,
    which runs every rank on whole sequences), attention is the model's own. ``pipelined``: a pipeline stage,
    whose forward the schedule calls with its inputs alone (always slices of unpacked rows: positions follow from
    the layout, ``stage_positions``)."""

    def __init__(self, group, fallback: str, block: BlockAttention = eager_block_attention, pipelined: bool = False):
        self.group, self.fallback, self.block, self.pipelined = group, fallback, block, pipelined
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self.active = False
        self.all_segment_ids: torch.Tensor | None = None  # every rank's, gathered once a forward (not per layer)

    def begin(self, active: bool, segment_ids: torch.Tensor | None) -> None:
        """A forward starts (``CausalLM.forward``): on this rank's slices (``active``) or on whole rows."""
        self.active = active
        self.all_segment_ids = _all_segment_ids(segment_ids, self.group) if active else None

    def stage_positions(self, local_len: int, device) -> torch.Tensor:
        """The global positions (1, local_len) of this rank's slice of an unpacked row."""
        return positions(local_len * self.size, self.size, self.rank, device)[None]

    def split_batch(self, x, targets, position_ids=None, segment_ids=None) -> tuple:
        """This rank's slices of whole rows (targets shifted already, so a chunk's last target is the next
        chunk's first input) and the global positions RoPE needs (a packed row's own positions, split)."""
        n, r = self.size, self.rank
        pos = split(position_ids, n, r, 1) if position_ids is not None else positions(x.shape[1], n, r, x.device)[None]
        segs = split(segment_ids, n, r, 1) if segment_ids is not None else None
        return split(x, n, r, 1), split(targets, n, r, 1), pos, segs

    def attention(self, q, k, v, scale) -> torch.Tensor:
        return _RingAttention.apply(q, k, v, self.group, softmax_scale(q, scale), self.all_segment_ids, self.block)

    def kernel_attention(self, own):
        """The kernel registry's attention op (``models.fused``), ring attention while active."""

        def attention(q, k, v, causal=True, window=None, scale=None):
            return (
                self.attention(q, k, v, scale)
                if self.active
                else own(q, k, v, causal=causal, window=window, scale=scale)
            )

        return attention


def _transformers_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers' attention interface: ring attention while the model's ContextParallel is active."""
    cp: ContextParallel = module.context_parallel
    if not cp.active:
        own = ALL_ATTENTION_FUNCTIONS.get_interface(cp.fallback, eager_attention_forward)
        return own(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    return cp.attention(query, key, value, scaling).transpose(1, 2).contiguous(), None


def apply_context_parallel(
    model, group, block: BlockAttention = eager_block_attention, pipelined: bool = False
) -> ContextParallel:
    """Route every attention of ``model`` (a CausalLM) through ring attention over ``group``, each block on
    ``block`` (the registry's ``attention_block`` the recipe's kernels select): transformers' attention interface,
    or the kernel registry's attention op where ``model.kernels`` replaced the modules. ``pipelined``: ``model``
    is a pipeline stage (every forward on this rank's slices)."""
    if any(w is not None for w in layer_windows(model.config)):
        raise RecipeError(
            "distributed.context_parallel_size > 1 with a sliding-window attention (the model's sliding_window) is "
            "not built yet: ring attention masks by global position only"
        )
    AttentionInterface.register(ATTENTION_NAME, _transformers_attention)
    cp = ContextParallel(group, model.config._attn_implementation, block, pipelined)
    for layer in model.layers():
        attn = layer.self_attn
        attn.context_parallel = cp
        if hasattr(attn, "_attention"):  # models.fused.FusedAttention
            attn._attention = cp.kernel_attention(attn._attention)
    model.config._attn_implementation = ATTENTION_NAME
    model.context_parallel = cp
    return cp
