"""The numerics-and-speed check harness behind ``canntrain kernels check``: for each op x backend x dtype x shape,
the registered kernel measured by :mod:`canntrain_kernels.numerics` (forward and backward against the fp64
reference definition on the CPU, a fixed random upstream gradient; speed after warm-up), or skipped with the
reason its backend is unavailable here.
"""

from __future__ import annotations

from typing import Callable, Sequence

from canntrain_kernels import registry
from canntrain_kernels.cases import parse_dtype, parse_shape
from canntrain_kernels.numerics import TOLERANCES, Record, measure

__all__ = ["TOLERANCES", "Record", "check_one", "failed", "format_table", "run_check"]


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
    if fn is None:
        reason = registry.unavailable_reason(op, backend, device)
        if reason is not None:
            return Record(op, backend, dtype, shape, device, "skip", reason, tol=TOLERANCES[dtype])
        fn = registry.kernel(op, backend).fn
    return measure(op, backend, fn, dtype, shape, device, timing, warmup, repeat)


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
