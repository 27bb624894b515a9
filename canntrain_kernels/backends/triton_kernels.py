"""Triton kernels for the cuda backend: RMSNorm, RoPE and SwiGLU, forward and backward.

Imported only when triton is installed (canntrain_kernels.backends.cuda checks first). All arithmetic is
in fp32; results are stored in the output's dtype. Each op is a torch.autograd.Function so the
model's backward runs the Triton backward kernels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


# ------------------------------------------------------------------------------------ RMSNorm
@triton.jit
def _rms_fwd(X, W, Y, RSTD, n_cols, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(X + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    normed = (x * rstd).to(X.dtype.element_ty).to(tl.float32)  # round like the reference does
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * n_cols + cols, (w * normed).to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + row, rstd)


@triton.jit
def _rms_bwd(DY, X, W, RSTD, DX, DW_PARTIAL, n_rows, n_cols, rows_per_prog, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK,), dtype=tl.float32)
    for i in range(0, rows_per_prog):
        row = pid * rows_per_prog + i
        m = mask & (row < n_rows)  # the last program may have fewer rows
        x = tl.load(X + row * n_cols + cols, mask=m, other=0.0).to(tl.float32)
        dy = tl.load(DY + row * n_cols + cols, mask=m, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + row, mask=row < n_rows, other=0.0)
        n = x * rstd
        g = dy * w
        dx = rstd * (g - n * (tl.sum(g * n, axis=0) / n_cols))
        tl.store(DX + row * n_cols + cols, dx.to(DX.dtype.element_ty), mask=m)
        dw += dy * n
    tl.store(DW_PARTIAL + pid * n_cols + cols, dw, mask=mask)


class RMSNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).contiguous()
        rows, cols = x2.shape
        out_dtype = torch.promote_types(x.dtype, weight.dtype)
        y = torch.empty((rows, cols), dtype=out_dtype, device=x.device)
        rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
        block = triton.next_power_of_2(cols)
        _rms_fwd[(rows,)](x2, weight.contiguous(), y, rstd, cols, eps, BLOCK=block)
        ctx.save_for_backward(x2, weight, rstd)
        ctx.shape = shape
        return y.reshape(shape)

    @staticmethod
    def backward(ctx, dy):
        x2, weight, rstd = ctx.saved_tensors
        rows, cols = x2.shape
        dy2 = dy.reshape(rows, cols).contiguous()
        dx = torch.empty_like(x2)
        n_prog = min(rows, 4 * torch.cuda.get_device_properties(x2.device).multi_processor_count)
        per = triton.cdiv(rows, n_prog)
        partial = torch.empty((n_prog, cols), dtype=torch.float32, device=x2.device)
        block = triton.next_power_of_2(cols)
        _rms_bwd[(n_prog,)](dy2, x2, weight.contiguous(), rstd, dx, partial, rows, cols, per, BLOCK=block)
        return dx.reshape(ctx.shape), partial.sum(0).to(weight.dtype), None


# ------------------------------------------------------------------------------------ SwiGLU
@triton.jit
def _swiglu_fwd(G, U, Y, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
    y = g * tl.sigmoid(g) * u
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd(DY, G, U, DG, DU, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    silu = g * sig
    tl.store(DG + offs, (dy * u * sig * (1.0 + g * (1.0 - sig))).to(DG.dtype.element_ty), mask=mask)
    tl.store(DU + offs, (dy * silu).to(DU.dtype.element_ty), mask=mask)


_EW_BLOCK = 1024


class SwiGLUFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        gate, up = gate.contiguous(), up.contiguous()
        y = torch.empty_like(gate)
        n = gate.numel()
        _swiglu_fwd[(triton.cdiv(n, _EW_BLOCK),)](gate, up, y, n, BLOCK=_EW_BLOCK)
        ctx.save_for_backward(gate, up)
        return y

    @staticmethod
    def backward(ctx, dy):
        gate, up = ctx.saved_tensors
        dy = dy.contiguous()
        dg, du = torch.empty_like(gate), torch.empty_like(up)
        n = gate.numel()
        _swiglu_bwd[(triton.cdiv(n, _EW_BLOCK),)](dy, gate, up, dg, du, n, BLOCK=_EW_BLOCK)
        return dg, du


# ------------------------------------------------------------------------------------ RoPE
@triton.jit
def _rope(
    X, COS, SIN, Y, heads, seq, cos_batch_stride, HALF: tl.constexpr, BLOCK: tl.constexpr, BACKWARD: tl.constexpr
):
    # One program per (b, h, s) row of D = 2 * HALF values.
    row = tl.program_id(0)
    b = row // (heads * seq)
    s = row % seq
    d = tl.arange(0, BLOCK)
    mask = d < HALF
    base = row * 2 * HALF
    x1 = tl.load(X + base + d, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(X + base + HALF + d, mask=mask, other=0.0).to(tl.float32)
    cbase = b * cos_batch_stride + s * 2 * HALF
    c1 = tl.load(COS + cbase + d, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(COS + cbase + HALF + d, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(SIN + cbase + d, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(SIN + cbase + HALF + d, mask=mask, other=0.0).to(tl.float32)
    if BACKWARD:  # transpose of y = x*cos + rotate_half(x)*sin
        y1 = x1 * c1 + x2 * s2
        y2 = x2 * c2 - x1 * s1
    else:
        y1 = x1 * c1 - x2 * s1
        y2 = x2 * c2 + x1 * s2
    tl.store(Y + base + d, y1.to(Y.dtype.element_ty), mask=mask)
    tl.store(Y + base + HALF + d, y2.to(Y.dtype.element_ty), mask=mask)


def _rope_launch(x, cos, sin, backward: bool):
    x = x.contiguous()
    bsz, heads, seq, dim = x.shape
    y = torch.empty_like(x)
    cos_batch_stride = 0 if cos.shape[0] == 1 else seq * dim
    half = dim // 2
    _rope[(bsz * heads * seq,)](
        x,
        cos,
        sin,
        y,
        heads,
        seq,
        cos_batch_stride,
        HALF=half,
        BLOCK=triton.next_power_of_2(half),
        BACKWARD=backward,
    )
    return y


class RoPEFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos, sin):
        cos, sin = cos.contiguous(), sin.contiguous()
        ctx.save_for_backward(cos, sin)
        return _rope_launch(q, cos, sin, False), _rope_launch(k, cos, sin, False)

    @staticmethod
    def backward(ctx, dq, dk):
        cos, sin = ctx.saved_tensors
        return _rope_launch(dq, cos, sin, True), _rope_launch(dk, cos, sin, True), None, None
