"""The numerics-and-speed check harness behind ``canntrain kernels check``.

For each op x backend x dtype x shape: run the backend forward and backward (a fixed random
upstream gradient), run the reference definition in fp64 on the CPU on the same inputs, and
compare the output and the gradient of every differentiable input. The error of a tensor is

    abs = max |y - y_ref|,   rel = abs / max |y_ref|

(relative to the tensor's scale, so values near zero do not blow it up). A backend passes when
every rel is within the dtype's tolerance. Speed is the median of repeated forward and
forward+backward runs after warm-up, with the device synchronised around each run.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import Callable, Iterable, Sequence

import torch

from canntrain_kernels import registry
from canntrain_kernels.cases import SHAPES, Case, make_case, parse_dtype, parse_shape, truth_fn

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


def check_one(
    op: str,
    backend: str,
    dtype: str,
    shape: str,
    device: str | None = None,
    timing: bool = True,
    warmup: int = 2,
    repeat: int = 5,
    fn: Callable | None = None,
) -> Record:
    """Check one backend of one op (``fn`` replaces the registered kernel, e.g. in tests)."""
    device = device or registry.current_device()
    tol = TOLERANCES[dtype]
    rec = Record(op, backend, dtype, shape, device, "skip", tol=tol)
    if fn is None:
        reason = registry.unavailable_reason(op, backend, device)
        if reason is not None:
            rec.reason = reason
            return rec
        fn = registry.kernel(op, backend).fn
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


def run_check(
    ops: Sequence[str] | None = None,
    backends: Sequence[str] | None = None,
    dtypes: Sequence[str] = ("fp32", "bf16"),
    shapes: Sequence[str] = ("small",),
    device: str | None = None,
    timing: bool = True,
    warmup: int = 2,
    repeat: int = 5,
    progress: Callable[[Record], None] | None = None,
) -> list[Record]:
    """Every op x backend x dtype x shape; unavailable backends come back as ``skip`` with the reason."""
    ops = list(ops or registry.OPS)
    backends = list(backends or registry.BACKENDS)
    for op in ops:
        if op not in registry.OPS:
            raise ValueError(f"unknown op {op!r}; ops are {', '.join(registry.OPS)}")
    for b in backends:
        if b not in registry.BACKENDS:
            raise ValueError(f"unknown backend {b!r}; backends are {', '.join(registry.BACKENDS)}")
    for d in dtypes:
        parse_dtype(d)
        if d not in TOLERANCES:
            raise ValueError(f"no tolerance for dtype {d!r}")
    for s in shapes:
        parse_shape(s)
    records = []
    for shape in shapes:
        for op in ops:
            for dtype in dtypes:
                for backend in backends:
                    rec = check_one(op, backend, dtype, shape, device, timing, warmup, repeat)
                    records.append(rec)
                    if progress is not None:
                        progress(rec)
    return records


def verify(op: str, backend: str, device: str, dtypes: Sequence[str] = ("fp32",)) -> str | None:
    """The registry's quick check before "auto" uses a backend: None if it passes, else why not."""
    for dtype in dtypes:
        rec = check_one(op, backend, dtype, "verify", device, timing=False)
        if rec.status != "pass":
            return f"failed its {dtype} numerics check ({rec.reason})"
    return None


def format_table(records: Sequence[Record]) -> str:
    """A plain-text table, one row per record."""
    head = ("op", "backend", "dtype", "shape", "status", "fwd rel", "bwd rel", "tol", "fwd ms", "f+b ms", "note")

    def num(x: float | None, fmt: str) -> str:
        return "-" if x is None else format(x, fmt)

    rows = [
        (
            r.op,
            r.backend,
            r.dtype,
            r.shape,
            r.status,
            num(r.fwd_rel, ".1e"),
            num(r.bwd_rel, ".1e"),
            num(r.tol, ".0e"),
            num(r.fwd_ms, ".3f"),
            num(r.fwd_bwd_ms, ".3f"),
            r.reason[:60],
        )
        for r in records
    ]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([line(head), line(["-" * w for w in widths])] + [line(r) for r in rows])


def failed(records: Sequence[Record]) -> list[Record]:
    return [r for r in records if r.status in ("fail", "error")]


__all__ = ["Record", "TOLERANCES", "SHAPES", "check_one", "run_check", "verify", "format_table", "failed", "compare"]
