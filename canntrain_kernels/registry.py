"""The kernel registry: which implementation of each op runs, and why.

Every (op, backend) pair is a :class:`Kernel` registered by a module in ``canntrain_kernels.backends``.
``get(op, backend)`` returns its function; ``backend="auto"`` walks the device's preference
order (fastest first, as measured by ``benchmarks/kernel_speed.py``) and returns the first backend
that is available here *and* passes its numerics check (forward and backward against an fp64
reference, :func:`canntrain_kernels.numerics.verify`). A backend whose device or library is missing is never
selected; asking for it by name raises :class:`KernelUnavailable` with the reason.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Callable

from canntrain_kernels.device import device_type
from canntrain_kernels.numerics import verify

OPS = ("rms_norm", "apply_rotary", "swiglu", "attention", "cross_entropy", "expert_mlp", "attention_block")
BACKENDS = ("npu", "cuda", "cpu", "compile", "eager")
CHOICES = ("auto",) + BACKENDS

# Fastest first, per device type. CPU: benchmarks/kernel_speed.py --threads 1 measured compile ahead of
# eager for every op at the tiny preset's training shapes (RMSNorm about 6x, RoPE, SwiGLU and
# attention about 1.7-1.9x forward+backward, the chunked loss about 1.1x).
# A mixture of experts' expert_mlp has no compile backend (its rows per expert are data): the device's grouped
# matmul, else the loop. A ring attention's attention_block (kernels.block_attention) is a forward and a backward
# called by the ring, not a graph to compile: the device's fused attention that returns its log-sum-exp (the
# "cpu" backend is torch's flash attention for CPU), else tiled matmuls; CUDA has none yet.
_NO_COMPILE = ("expert_mlp", "attention_block")
AUTO_ORDER: dict[str, dict[str, tuple[str, ...]]] = {
    "npu": {op: ("npu", "eager") if op in _NO_COMPILE else ("npu", "compile", "eager") for op in OPS},
    "cuda": {op: ("cuda", "eager") if op in _NO_COMPILE else ("cuda", "compile", "eager") for op in OPS},
    "cpu": {
        "expert_mlp": ("eager",),
        "attention_block": ("cpu", "eager"),
        "rms_norm": ("compile", "eager"),
        "apply_rotary": ("compile", "eager"),
        "swiglu": ("compile", "eager"),
        "attention": ("compile", "eager"),
        "cross_entropy": ("compile", "eager"),
    },
}


class KernelUnavailable(RuntimeError):
    """The requested backend cannot run here; the message says why."""


@dataclass
class Kernel:
    """One implementation of one op."""

    op: str
    backend: str
    fn: Callable
    devices: tuple[str, ...]  # device types it runs on
    probe: Callable[[], str | None] = lambda: None  # None when usable, else why not
    note: str = ""

    def unavailable_reason(self, device: str) -> str | None:
        if device not in self.devices:
            return f"{self.backend} {self.op} runs on {'/'.join(self.devices)}, not {device}"
        return self.probe()


_KERNELS: dict[tuple[str, str], Kernel] = {}
_VERIFIED: dict[tuple, str | None] = {}  # (op, backend, device, dtypes) -> failure or None
_LOADED = False


def register(kernel: Kernel) -> Kernel:
    if kernel.op not in OPS:
        raise ValueError(f"unknown op {kernel.op!r}; ops are {', '.join(OPS)}")
    if kernel.backend not in BACKENDS:
        raise ValueError(f"unknown backend {kernel.backend!r}; backends are {', '.join(BACKENDS)}")
    _KERNELS[(kernel.op, kernel.backend)] = kernel
    return kernel


def _load() -> None:
    global _LOADED
    if not _LOADED:
        _LOADED = True
        for name in ("eager", "compile", "npu", "cuda", "cpu"):
            importlib.import_module(f"canntrain_kernels.backends.{name}")


def current_device() -> str:
    """The device type kernels run on by default: npu > cuda > cpu, or $CANNTRAIN_DEVICE (:mod:`.device`)."""
    return device_type()


def _check_op(op: str) -> None:
    if op not in OPS:
        raise KeyError(f"unknown kernel op {op!r}; ops are {', '.join(OPS)}")


def kernel(op: str, backend: str) -> Kernel | None:
    """The registered Kernel of (op, backend), or None when that backend has no such op."""
    _load()
    _check_op(op)
    return _KERNELS.get((op, backend))


def unavailable_reason(op: str, backend: str, device: str | None = None) -> str | None:
    """None when ``backend`` can run ``op`` on ``device`` (default: this machine's), else why not."""
    k = kernel(op, backend)
    if k is None:
        return f"backend {backend!r} has no {op} kernel"
    return k.unavailable_reason(device or current_device())


def available_backends(op: str, device: str | None = None) -> list[str]:
    """Backends that can run ``op`` here, in the device's auto order (fastest first)."""
    device = device or current_device()
    order = AUTO_ORDER.get(device, AUTO_ORDER["cpu"]).get(op, BACKENDS)
    rest = [b for b in BACKENDS if b not in order]
    return [b for b in (*order, *rest) if unavailable_reason(op, b, device) is None]


def verified(op: str, backend: str, device: str, dtypes: tuple[str, ...] = ("fp32",)) -> str | None:
    """Run (once per process) the quick numerics check of a backend; None if it passed, else why not."""
    key = (op, backend, device, tuple(dtypes))
    if key not in _VERIFIED:
        _VERIFIED[key] = verify(op, backend, kernel(op, backend).fn, device, dtypes)
    return _VERIFIED[key]


@dataclass
class Selection:
    """What ``select`` chose for one op, and what it passed over on the way."""

    op: str
    requested: str
    backend: str
    device: str
    skipped: dict[str, str] = field(default_factory=dict)  # backend -> reason

    def __str__(self) -> str:
        why = "; ".join(f"{b}: {r}" for b, r in self.skipped.items())
        return f"{self.op}: {self.backend}" + (f" (skipped {why})" if why else "")


def select(op: str, backend: str = "auto", device: str | None = None, dtypes: tuple[str, ...] = ("fp32",)) -> Selection:
    """Resolve ``backend`` (a name or "auto") for ``op`` on ``device`` to a concrete backend.

    "auto" takes the first backend of the device's order that is available and passes its
    numerics check in each of ``dtypes``; an explicitly named backend is used as asked.
    """
    _load()
    _check_op(op)
    device = device or current_device()
    if backend not in CHOICES:
        raise KeyError(f"unknown kernel backend {backend!r}; choose one of {', '.join(CHOICES)}")
    if backend != "auto":
        reason = unavailable_reason(op, backend, device)
        if reason is not None:
            raise KernelUnavailable(f"kernels: {op} backend {backend!r} is not available: {reason}")
        return Selection(op, backend, backend, device)
    skipped: dict[str, str] = {}
    order = AUTO_ORDER.get(device, AUTO_ORDER["cpu"]).get(op, BACKENDS)
    for candidate in order:
        reason = unavailable_reason(op, candidate, device)
        if reason is None and candidate != "eager":
            reason = verified(op, candidate, device, tuple(dtypes))
        if reason is None:
            return Selection(op, "auto", candidate, device, skipped)
        skipped[candidate] = reason
    return Selection(op, "auto", "eager", device, skipped)  # the reference is always there


def get(op: str, backend: str = "auto", device: str | None = None, dtypes: tuple[str, ...] = ("fp32",)) -> Callable:
    """The function implementing ``op`` with ``backend`` ("auto": fastest checked one available here)."""
    sel = select(op, backend, device, dtypes)
    return _KERNELS[(op, sel.backend)].fn


def resolve(default: str = "eager", overrides: dict[str, str] | None = None) -> dict[str, str]:
    """Requested backend per op: ``overrides`` (op -> backend) win over ``default``; an op the default backend
    does not implement (compile has no expert_mlp, cpu only a ring's attention_block) runs eager."""
    overrides = dict(overrides or {})
    for op, b in overrides.items():
        _check_op(op)
        if b not in CHOICES:
            raise KeyError(f"kernel override {op}={b!r}: choose one of {', '.join(CHOICES)}")
    if default not in CHOICES:
        raise KeyError(f"unknown kernel backend {default!r}; choose one of {', '.join(CHOICES)}")

    def fallback(op: str) -> str:
        return default if default == "auto" or kernel(op, default) is not None else "eager"

    return {op: overrides.get(op) or fallback(op) for op in OPS}
