"""The ranks of tests/parallel/test_context_parallel.py (``main`` on forked local ranks, or this file under torchrun):
context-parallel attention on cp gloo ranks.

    torchrun --nproc_per_node CP tests/_cp_ranks.py OUT

Every rank builds the same whole q/k/v and upstream gradient (seeded), takes its load-balanced slice, runs
ring_attention (its blocks on the registry's eager and cpu attention_block) and allgather_attention forward and
backward, gathers output, dq, dk and dv back to sequence
order and compares them with F.scaled_dot_product_attention on the whole sequence. Saves OUT/rank<R>.pt: a dict
{case name: largest absolute difference over output, dq, dk, dv}.
"""

import os
import sys
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from canntrain_core.parallel import context
from canntrain_core.parallel.context import allgather_attention, gather_sequence, ring_attention, split
from canntrain_kernels.block_attention import cpu_block_attention

BATCH, HEADS, HEAD_DIM = 2, 4, 8


def full_attention(q, k, v, scale, segments):
    """The reference: causal SDPA over the whole sequence, within documents when ``segments`` is given."""
    if segments is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    n = q.shape[2]
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    mask = causal & (segments[:, :, None] == segments[:, None, :])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], scale=scale, enable_gqa=True)


def case(attention, seq_len: int, kv_heads: int, dtype, scale=None, documents: int = 0) -> float:
    """The largest difference between ``attention`` on this rank's slices and the whole sequence's reference."""
    cp, rank = dist.get_world_size(), dist.get_rank()
    g = torch.Generator().manual_seed(seq_len * 10 + kv_heads)  # the same whole tensors on every rank
    q = torch.randn(BATCH, HEADS, seq_len, HEAD_DIM, generator=g, dtype=dtype)
    k, v = (torch.randn(BATCH, kv_heads, seq_len, HEAD_DIM, generator=g, dtype=dtype) for _ in range(2))
    dout = torch.randn(BATCH, HEADS, seq_len, HEAD_DIM, generator=g, dtype=dtype)
    segments = None
    if documents:  # sorted ids: contiguous documents of random lengths
        segments = torch.randint(0, documents, (BATCH, seq_len), generator=g).sort(dim=1).values

    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = full_attention(*full, scale, segments)
    ref.backward(dout)

    local = [split(t, cp, rank, dim=2).requires_grad_() for t in (q, k, v)]
    seg = None if segments is None else split(segments, cp, rank, dim=1)
    out = attention(*local, scale=scale, segment_ids=seg)
    out.backward(split(dout, cp, rank, dim=2))
    pairs = [(out.detach(), ref.detach())] + [(t.grad, f.grad) for t, f in zip(local, full)]
    return max((gather_sequence(mine, None, dim=2) - want).abs().max().item() for mine, want in pairs)


def main(out: str) -> None:
    dist.init_process_group("gloo")
    cp = dist.get_world_size()
    results = {}
    ring_cpu = partial(ring_attention, block=cpu_block_attention)
    for name, attention in (("ring", ring_attention), ("ring_cpu", ring_cpu), ("allgather", allgather_attention)):
        for chunk in (3, 4):  # odd and even chunk lengths
            seq = 2 * cp * chunk
            results[f"{name}_gqa_s{seq}"] = case(attention, seq, 2, torch.float64)
        results[f"{name}_mha_scale"] = case(attention, 2 * cp * 3, HEADS, torch.float64, scale=0.3)
        results[f"{name}_documents"] = case(attention, 2 * cp * 4, 2, torch.float64, documents=4)
        results[f"{name}_fp32"] = case(attention, 2 * cp * 4, 2, torch.float32)
    context.RING_QUERY_TILE = 3  # the ring's blocks in tiles of 3 query rows (256 in use): the same attention
    results["ring_tiled_documents"] = case(ring_attention, 2 * cp * 4, 2, torch.float64, documents=4)
    results["ring_cpu_tiled_documents"] = case(ring_cpu, 2 * cp * 4, 2, torch.float64, documents=4)
    torch.save(results, Path(out) / f"rank{dist.get_rank()}.pt")
    dist.barrier()  # no rank tears gloo down while another is still in its last exchange
    dist.destroy_process_group()
    os._exit(0)  # as tests/_ep_ranks.py: skip C++ static destructors that rarely abort after gloo's teardown


if __name__ == "__main__":
    main(*sys.argv[1:])
