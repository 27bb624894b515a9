"""The numerics of one kernel: its forward and backward against the fp64 reference definition, and its speed.

The error of a tensor is

    abs = max |y - y_ref|,   rel = abs / max |y_ref|

(relative to the tensor's scale, so values near zero do not blow it up). A kernel passes when every rel is within
the dtype's tolerance. Speed is the median of repeated forward and forward+backward runs after warm-up, with the
device synchronised around each run. No registry here: the registry's own check before ``auto`` picks a backend
(:func:`verify`) and the harness (``check.py``) both call in.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import Callable, Iterable, Sequence

import torch

from canntrain_kernels.cases import Case, make_case, parse_dtype, parse_shape, truth_fn

# Max relative error (see module docstring) allowed per dtype, forward and backward.
TOLERANCES = {"fp64": 1e-10, "fp32": 2e-5, "bf16": 2e-2, "fp16": 3e-3}


@dataclass
class Record:
    """One op x backend x dtype x shape result; ``status`` is pass, fail, skip or error."""

    op: str
    backend: str
    dtype: str
    shape: str
    device: str
    status: str
    reason: str = ""
    fwd_abs: float | None = None
    fwd_rel: float | None = None
    bwd_abs: float | None = None
    bwd_rel: float | None = None
    tol: float | None = None
    fwd_ms: float | None = None
    fwd_bwd_ms: float | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def _sync(device: str) -> None:
    mod = getattr(torch, device, None) if device != "cpu" else None
    if mod is not None and hasattr(mod, "synchronize"):
        mod.synchronize()


def _outputs(out) -> tuple[torch.Tensor, ...]:
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def _with_grad(case: Case) -> tuple:
    return tuple(
        a.detach().clone().requires_grad_(True) if i in case.differentiable else a for i, a in enumerate(case.args)
    )


def _upstream(outs: Sequence[torch.Tensor], seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(o.shape, generator=g, dtype=torch.float64) for o in outs]


def _forward_backward(fn: Callable, case: Case, args: tuple, grads_up: list[torch.Tensor] | None):
    outs = _outputs(case.call(fn, args))
    if grads_up is None:
        grads_up = _upstream(outs)
    ups = [g.to(dtype=o.dtype, device=o.device) for g, o in zip(grads_up, outs)]
    inputs = [args[i] for i in case.differentiable]
    graded = [(o, u) for o, u in zip(outs, ups) if o.requires_grad]  # a statistic (a block's lse) has none
    grads = torch.autograd.grad([o for o, _ in graded], inputs, [u for _, u in graded], allow_unused=True)
    return outs, grads, grads_up


def _error(got: Iterable[torch.Tensor | None], want: Iterable[torch.Tensor | None]) -> tuple[float, float]:
    worst_abs = worst_rel = 0.0
    for a, b in zip(got, want):
        if a is None or b is None:
            if a is None and b is None:
                continue
            return float("inf"), float("inf")  # a gradient missing on one side only
        a = a.detach().to("cpu", torch.float64)
        b = b.detach().to("cpu", torch.float64)
        if a.shape != b.shape:
            return float("inf"), float("inf")
        if not torch.isfinite(a).all():
            return float("inf"), float("inf")
        err = (a - b).abs().max().item() if a.numel() else 0.0
        scale = b.abs().max().item() if b.numel() else 0.0
        worst_abs = max(worst_abs, err)
        worst_rel = max(worst_rel, err / scale if scale > 0 else err)
    return worst_abs, worst_rel


def compare(fn: Callable, op: str, case: Case) -> dict[str, float]:
    """Errors of ``fn`` on ``case`` against the fp64 definition: fwd_abs, fwd_rel, bwd_abs, bwd_rel."""
    outs, grads, ups = _forward_backward(fn, case, _with_grad(case), None)
    ref_case = Case(
        op,
        tuple(a.detach().to("cpu", torch.float64) if a.is_floating_point() else a.cpu() for a in case.args),
        {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in case.kwargs.items()},
        case.differentiable,
    )
    ref_outs, ref_grads, _ = _forward_backward(truth_fn(op), ref_case, _with_grad(ref_case), ups)
    fwd_abs, fwd_rel = _error(outs, ref_outs)
    bwd_abs, bwd_rel = _error(grads, ref_grads)
    return dict(fwd_abs=fwd_abs, fwd_rel=fwd_rel, bwd_abs=bwd_abs, bwd_rel=bwd_rel)


def time_ms(fn: Callable, case: Case, device: str, backward: bool, warmup: int = 2, repeat: int = 5) -> float:
    """Median wall time in ms of one training forward (and backward) of ``fn`` on ``case``.

    The forward-only time is also taken with inputs that require grad (as in training), which
    lets a compiled kernel reuse the graph it compiled for forward+backward.
    """
    args = _with_grad(case)
    outs = [o for o in _outputs(case.call(fn, args)) if o.requires_grad]
    ups = [torch.ones_like(o) for o in outs]
    inputs = [args[i] for i in case.differentiable]
    times = []
    for i in range(warmup + repeat):
        _sync(device)
        t0 = time.perf_counter()
        outs = [o for o in _outputs(case.call(fn, args)) if o.requires_grad]
        if backward:
            torch.autograd.grad(outs, inputs, ups, allow_unused=True)
        _sync(device)
        if i >= warmup:
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def measure(
    op: str,
    backend: str,
    fn: Callable,
    dtype: str,
    shape: str,
    device: str,
    timing: bool = True,
    warmup: int = 2,
    repeat: int = 5,
) -> Record:
    """The Record of kernel ``fn`` (``backend``'s ``op``) on one dtype and shape."""
    tol = TOLERANCES[dtype]
    rec = Record(op, backend, dtype, shape, device, "skip", tol=tol)
    try:
        case = make_case(op, parse_shape(shape), parse_dtype(dtype), device)
        for key, value in compare(fn, op, case).items():
            setattr(rec, key, value)
        worst = max(rec.fwd_rel, rec.bwd_rel)
        rec.status = "pass" if worst <= tol else "fail"
        if rec.status == "fail":
            rec.reason = f"max rel error {worst:.3g} > tolerance {tol:g}"
        if timing:
            rec.fwd_ms = time_ms(fn, case, device, False, warmup, repeat)
            rec.fwd_bwd_ms = time_ms(fn, case, device, True, warmup, repeat)
    except Exception as e:  # a kernel that crashes is reported, not fatal to the table
        rec.status, rec.reason = "error", f"{type(e).__name__}: {e}".splitlines()[0][:200]
    return rec


def verify(op: str, backend: str, fn: Callable, device: str, dtypes: Sequence[str] = ("fp32",)) -> str | None:
    """The registry's quick check before "auto" uses a backend: None if it passes, else why not."""
    for dtype in dtypes:
        rec = measure(op, backend, fn, dtype, "verify", device, timing=False)
        if rec.status != "pass":
            return f"failed its {dtype} numerics check ({rec.reason})"
    return None
