"""Chunked ("fused linear") cross-entropy: the LM loss without the full [N, V] fp32 logits.

For rows n = 1..N with hidden h_n, output projection W [V, h] and target t_n:

    z_n = W h_n                        (logits, one row of V)
    loss = 1/M * sum_n (logsumexp(z_n) - z_n[t_n])     over the M rows whose target != ignore_index
    dL/dz_n = (softmax(z_n) - onehot(t_n)) / M
    dL/dh_n = W^T dL/dz_n,   dL/dW = sum_n dL/dz_n h_n^T

The plain loss keeps all N x V logits (and their fp32 copy and gradient) alive between forward
and backward. Here the rows are processed ``chunk_size`` at a time and each chunk's gradients
are computed right away in the forward pass, so at most one [chunk, V] block of fp32 logits ever
exists; backward only scales the stored gradients by the incoming grad_output.
"""

from __future__ import annotations

from typing import Callable

import torch

# Aim for about 4M fp32 logits (16 MiB) per chunk, but never fewer rows than this.
_TARGET_CHUNK_ELEMENTS = 1 << 22
_MIN_CHUNK_ROWS = 128


def default_chunk_size(n_rows: int, vocab: int) -> int:
    """Rows per chunk so one chunk of fp32 logits is about 16 MiB (at least 128 rows)."""
    return max(1, min(n_rows, max(_MIN_CHUNK_ROWS, _TARGET_CHUNK_ELEMENTS // max(vocab, 1))))


def chunk_loss_and_grads(
    h: torch.Tensor, weight: torch.Tensor, t: torch.Tensor, ignore_index: int, inv_count: torch.Tensor, need_grads: bool
):
    """One chunk: (sum of its losses, dL/dz for its rows in h's dtype, or None when no gradient is needed).

    ``inv_count`` is 1/M as a 0-dim tensor (M = non-ignored rows of the whole batch), so the chunks
    add up to the mean; a tensor, not a float, so a compiled chunk_fn is not recompiled per value of M.
    """
    acc = torch.promote_types(h.dtype, torch.float32)  # fp32, or fp64 for fp64 inputs
    logits = (h @ weight.t()).to(acc)
    valid = t != ignore_index
    safe_t = torch.where(valid, t, torch.zeros_like(t))
    lse = torch.logsumexp(logits, dim=-1)
    target_logit = logits.gather(1, safe_t[:, None]).squeeze(1)
    loss_sum = torch.where(valid, lse - target_logit, torch.zeros_like(lse)).sum()
    if not need_grads:
        return loss_sum, None
    # softmax = exp(z - lse), written over the logits (no longer needed) to keep one [chunk, V] buffer.
    grad = logits.sub_(lse[:, None]).exp_()
    grad.scatter_add_(1, safe_t[:, None], -torch.ones_like(target_logit)[:, None])
    grad.mul_((valid.to(grad.dtype) * inv_count.to(grad.dtype))[:, None])
    return loss_sum, grad.to(h.dtype)


ChunkFn = Callable[..., tuple]


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, ignore_index, chunk_size, chunk_fn):
        n = hidden.shape[0]
        count = int((targets != ignore_index).sum())
        acc = torch.promote_types(hidden.dtype, torch.float32)
        inv_count = torch.tensor(1.0 / count if count else 0.0, dtype=acc, device=hidden.device)
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden) if need_h else None
        # dL/dW accumulates over chunks in place: in fp32 (fp64) even for bf16/fp16 weights.
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        total = torch.zeros((), dtype=acc, device=hidden.device)
        for start in range(0, n, chunk_size):
            stop = min(start + chunk_size, n)
            h = hidden[start:stop]
            loss_sum, dz = chunk_fn(h, weight, targets[start:stop], ignore_index, inv_count, need_h or need_w)
            total = total + loss_sum
            if need_h:
                torch.mm(dz, weight, out=grad_h[start:stop])
            if need_w:
                if grad_w.dtype == dz.dtype:
                    grad_w.addmm_(dz.t(), h)
                else:
                    grad_w.add_(dz.t() @ h)  # one [V, h] product in the weight's dtype, added in fp32
        if need_w and grad_w.dtype != weight.dtype:
            grad_w = grad_w.to(weight.dtype)
        # Kept on ctx (not save_for_backward) so backward can hand them over without a copy.
        ctx.grads = (grad_h, grad_w)
        if not count:  # an all-ignored batch gives nan, as torch.nn.functional.cross_entropy does
            return torch.full_like(total, float("nan"))
        return total * inv_count

    @staticmethod
    def backward(ctx, grad_output):
        # The gradients were computed in forward for a loss weight of 1: scale them in place and
        # hand them over (no second [V, h] buffer). So this backward can run only once.
        if ctx.grads is None:
            raise RuntimeError("chunked cross_entropy: backward can run only once per forward (no retain_graph)")
        grad_h, grad_w = ctx.grads
        ctx.grads = None
        if grad_h is not None:
            grad_h.mul_(grad_output.to(grad_h.dtype))
        if grad_w is not None:
            grad_w.mul_(grad_output.to(grad_w.dtype))
        return grad_h, grad_w, None, None, None, None


def chunked_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int = -100,
    chunk_size: int | None = None,
    chunk_fn: ChunkFn = chunk_loss_and_grads,
) -> torch.Tensor:
    """Mean next-token loss of hidden [N, h] against targets [N] through weight [V, h], chunk by chunk.

    Returns an fp32 scalar (fp64 for fp64 inputs). ``chunk_fn`` computes one chunk; the compile
    backend passes a ``torch.compile``-d :func:`chunk_loss_and_grads`.
    """
    if hidden.dim() != 2 or weight.dim() != 2 or targets.dim() != 1:
        raise ValueError(
            "cross_entropy expects hidden [N, h], weight [V, h], targets [N]; got "
            f"{tuple(hidden.shape)}, {tuple(weight.shape)}, {tuple(targets.shape)}"
        )
    if hidden.shape[0] != targets.shape[0] or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"cross_entropy shape mismatch: hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)}, "
            f"targets {tuple(targets.shape)}"
        )
    if chunk_size is None:
        chunk_size = default_chunk_size(hidden.shape[0], weight.shape[0])
    if chunk_size < 1:
        raise ValueError(f"cross_entropy: chunk_size must be >= 1, got {chunk_size}")
    return _ChunkedCrossEntropy.apply(hidden, weight, targets, ignore_index, chunk_size, chunk_fn)
