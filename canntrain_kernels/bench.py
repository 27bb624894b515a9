"""Op-level measurements shared by benchmarks/kernel_speed.py and the fused-kernels notebook.

* :func:`backend_speed`: forward+backward time of each backend vs eager, per op and shape.
* :func:`cross_entropy_peak`: peak memory of the chunked vs the plain cross-entropy, fwd+bwd.

Whole training steps with a kernel choice are ``canntrain_core.train.throughput`` (they build models;
this package holds ops only).
"""

from __future__ import annotations

from typing import Sequence


from canntrain_kernels import registry
from canntrain_kernels.cases import make_case, parse_dtype, parse_shape
from canntrain_kernels.numerics import time_ms
from canntrain_kernels.memory import peak_bytes
from canntrain_kernels.reference import cross_entropy, plain_cross_entropy


def backend_speed(
    ops: Sequence[str] | None = None,
    shapes: Sequence[str] = ("tiny",),
    dtype: str = "fp32",
    backends: Sequence[str] | None = None,
    device: str | None = None,
    warmup: int = 3,
    repeat: int = 10,
) -> list[dict]:
    """Median forward and forward+backward ms of each available backend, and its speedup over eager."""
    device = device or registry.current_device()
    rows = []
    for shape in shapes:
        for op in ops or registry.OPS:
            case = make_case(op, parse_shape(shape), parse_dtype(dtype), device)
            eager_ms = None
            for backend in backends or registry.available_backends(op, device)[::-1]:  # eager first
                if registry.unavailable_reason(op, backend, device) is not None:
                    continue
                fn = registry.kernel(op, backend).fn
                fwd = time_ms(fn, case, device, False, warmup, repeat)
                fwd_bwd = time_ms(fn, case, device, True, warmup, repeat)
                if backend == "eager":
                    eager_ms = fwd_bwd
                rows.append(
                    dict(
                        op=op,
                        shape=shape,
                        dtype=dtype,
                        backend=backend,
                        fwd_ms=fwd,
                        fwd_bwd_ms=fwd_bwd,
                        speedup=(eager_ms / fwd_bwd) if eager_ms else None,
                    )
                )
    return rows


def cross_entropy_peak(
    n: int = 4096,
    hidden: int = 128,
    vocab: int = 4096,
    chunk_size: int | None = None,
    dtype: str = "fp32",
    device: str | None = None,
) -> dict:
    """Peak bytes of forward+backward of the plain and the chunked cross-entropy on the same inputs."""
    device = device or registry.current_device()
    shape = parse_shape(f"small:batch=1:seq={n}:hidden={hidden}:vocab={vocab}")
    h, w, t = make_case("cross_entropy", shape, parse_dtype(dtype), device).args

    def step(fn, **kw):
        a, b = h.clone().requires_grad_(), w.clone().requires_grad_()
        return lambda: fn(a, b, t, **kw).backward()

    plain = peak_bytes(step(plain_cross_entropy), device)
    chunked = peak_bytes(step(cross_entropy, chunk_size=chunk_size), device)
    return dict(
        n=n,
        hidden=hidden,
        vocab=vocab,
        dtype=dtype,
        logits_bytes=n * vocab * 4,
        plain_bytes=plain,
        chunked_bytes=chunked,
        ratio=plain / max(chunked, 1),
    )
