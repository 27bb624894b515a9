"""Vocabulary-parallel cross-entropy: the loss of a head sharded over the vocabulary, without the full logits.

Under TP with ``distributed.vocab_parallel`` the output head's rows (and the embedding's, which it may be)
are split over the ``tp`` ranks. Each rank multiplies the final hidden states (whole on every tp rank) by its
rows only and holds [tokens, vocab / tp] logits; the softmax's max and sum and the target's logit are
all-reduced over tp (three reductions of [tokens] floats, Megatron's vocab-parallel cross-entropy), so no rank
ever holds [tokens, vocab]. The hidden states enter as a tp-replicated DTensor: the gradient each rank's rows
give them is summed over tp by DTensor on the way back. Measured against the replicated head in
``tests/models/test_hf.py`` (FSDP2 x TP2 training equals one process) and ``benchmarks/vocab_parallel_memory.py``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor


def first_row(weight: DTensor) -> int:
    """The vocabulary id of this rank's first row of a weight split evenly over rows (Shard(0); the layout
    validator keeps the vocabulary divisible by tp)."""
    return weight.device_mesh.get_local_rank() * (weight.shape[0] // weight.device_mesh.size())


def vocab_sharded(weight: torch.Tensor) -> bool:
    """Whether ``weight`` (an output head's) is split over the vocabulary: a DTensor with Shard(0) on a mesh
    of one dimension (TP's, as FSDP2 presents it during forward)."""
    return isinstance(weight, DTensor) and weight.device_mesh.ndim == 1 and weight.placements[0] == Shard(0)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, first: int, group) -> torch.Tensor:
        """Per-token losses of local fp32 logits [N, V_local] whose columns are vocabulary ids first.. ;
        0 where the target is -100."""
        top = logits.max(dim=-1).values
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - top[:, None]
        exp = shifted.exp()
        total = exp.sum(dim=-1)
        dist.all_reduce(total, group=group)
        local = targets - first
        here = (local >= 0) & (local < logits.shape[-1])
        index = local.clamp(0, logits.shape[-1] - 1)
        target_logit = torch.where(here, shifted.gather(1, index[:, None]).squeeze(1), 0.0)
        dist.all_reduce(target_logit, group=group)
        valid = targets != -100
        ctx.save_for_backward(exp.div_(total[:, None]), here & valid, index, valid)
        return torch.where(valid, total.log() - target_logit, 0.0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        softmax, here, index, valid = ctx.saved_tensors
        g = softmax  # d loss / d logits = softmax - one_hot(target), per token
        g.scatter_add_(1, index[:, None], -here.to(g.dtype)[:, None])
        g.mul_((grad * valid)[:, None])
        return g, None, None, None


def vocab_parallel_cross_entropy(h: torch.Tensor, weight: DTensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss over the targets that are not -100, of hidden states ``h`` [N, hidden] (the same
    on every tp rank) and a vocabulary-sharded head ``weight`` (:func:`vocab_sharded`); fp32 logits, as the
    replicated path computes them."""
    mesh = weight.device_mesh
    hd = DTensor.from_local(h, mesh, [Replicate()], run_check=False)
    logits = F.linear(hd, weight).to_local().float()  # [N, V/tp]: Shard(-1) of the logits
    losses = _VocabParallelCrossEntropy.apply(logits, targets, first_row(weight), mesh.get_group())
    return losses.sum() / (targets != -100).sum().clamp(min=1)


class VocabParallelEmbedding(nn.Embedding):
    """An embedding whose rows are split over tp (Shard(0)): each rank looks up the ids in its own rows, zeros
    for the others', and the ranks' outputs are summed (all-reduce; a reduce-scatter along the sequence under
    SP). Its gradient stays a slice of the rows, as the parameter is (torch's RowwiseParallel on an embedding
    returns a whole, replicated gradient: a full vocabulary x hidden matrix per rank)."""

    output_layout: Shard | Replicate = Replicate()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        w = self.weight
        rows, first = w.to_local(), first_row(w)
        outside = (ids < first) | (ids >= first + rows.shape[0])
        out = F.embedding((ids - first).masked_fill(outside, 0), rows).masked_fill(outside[..., None], 0.0)
        summed = DTensor.from_local(out, w.device_mesh, [Partial()], run_check=False)
        return summed.redistribute(w.device_mesh, [self.output_layout]).to_local()


def shard_embedding(embedding: nn.Embedding, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
    """Make ``embedding`` a :class:`VocabParallelEmbedding` over ``tp_mesh`` in place (on meta or not)."""

    def rows(name, module, mesh):
        for key, p in list(module.named_parameters(recurse=False)):
            module.register_parameter(key, nn.Parameter(distribute_tensor(p, mesh, [Shard(0)])))

    distribute_module(embedding, tp_mesh, rows)
    embedding.__class__ = VocabParallelEmbedding
    embedding.output_layout = Shard(1) if sequence_parallel else Replicate()
