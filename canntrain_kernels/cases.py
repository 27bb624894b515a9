"""Named problem shapes and the inputs each op is checked and timed on.

A shape is given by name (``small``, ``odd``, ``window``, ``tiny``, ``1b``, ...) optionally
followed by ``:key=value`` changes, e.g. ``small:seq=100:kv_heads=1``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Any, Callable

import torch

from canntrain_kernels import reference

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64}


@dataclass(frozen=True)
class Shape:
    """One problem size for every op: a decoder layer's activations plus the LM head."""

    name: str
    batch: int
    seq: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    window: int | None = None

    def __post_init__(self) -> None:
        if self.heads % self.kv_heads:
            raise ValueError(f"shape {self.name}: heads={self.heads} is not a multiple of kv_heads={self.kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"shape {self.name}: head_dim={self.head_dim} must be even for RoPE")


SHAPES: dict[str, Shape] = {
    s.name: s
    for s in (
        # Quick default for `kernels check` on a CPU.
        Shape("small", batch=2, seq=64, hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=512),
        # Nothing a multiple of a block: seq 37, GQA ratio 8, vocab 301.
        Shape("odd", batch=3, seq=37, hidden=48, heads=8, kv_heads=1, head_dim=8, intermediate=72, vocab=301),
        # Sliding-window attention.
        Shape(
            "window", batch=2, seq=40, hidden=64, heads=4, kv_heads=4, head_dim=16, intermediate=96, vocab=256, window=9
        ),
        # The registry's quick numerics check before "auto" picks a backend.
        Shape("verify", batch=2, seq=19, hidden=32, heads=4, kv_heads=2, head_dim=8, intermediate=48, vocab=97),
        # The tiny llama preset at its training shape (micro-batch 8 x 128 tokens).
        Shape("tiny", batch=8, seq=128, hidden=128, heads=4, kv_heads=2, head_dim=32, intermediate=384, vocab=4096),
        # A 1B-class layer (Llama-3.2-1B widths, Llama-2 vocabulary), one 2048-token sequence.
        Shape("1b", batch=1, seq=2048, hidden=2048, heads=32, kv_heads=8, head_dim=64, intermediate=8192, vocab=32000),
    )
}


def parse_shape(spec: str) -> Shape:
    """``name`` or ``name:key=value:...`` -> Shape; errors name the bad part."""
    name, *changes = spec.split(":")
    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}; known: {', '.join(SHAPES)}")
    names = {f.name for f in fields(Shape)} - {"name"}
    updates: dict[str, Any] = {}
    for change in changes:
        key, sep, value = change.partition("=")
        if not sep or key not in names:
            raise ValueError(f"shape {spec!r}: expected key=value with key one of {', '.join(sorted(names))}")
        updates[key] = None if value.lower() in ("none", "null") else int(value)
    return replace(SHAPES[name], name=spec, **updates) if updates else SHAPES[name]


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; known: {', '.join(DTYPES)}")
    return DTYPES[name]


@dataclass
class Case:
    """Inputs of one op at one shape and dtype, and how to call it."""

    op: str
    args: tuple
    kwargs: dict
    differentiable: tuple[int, ...]  # positions in args whose gradients are checked

    def call(self, fn: Callable, args: tuple | None = None):
        return fn(*(self.args if args is None else args), **self.kwargs)


def rope_cos_sin(seq: int, head_dim: int, theta: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """fp64 cos/sin [1, seq, head_dim] exactly as transformers' default RoPE builds them."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    freqs = torch.arange(seq, dtype=torch.float64)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)[None]
    return emb.cos(), emb.sin()


def make_case(op: str, shape: Shape, dtype: torch.dtype, device: str | torch.device = "cpu", seed: int = 0) -> Case:
    """Random inputs (drawn in fp64 on the CPU, then cast and moved) for ``op`` at ``shape``."""
    g = torch.Generator().manual_seed(seed)

    def randn(*size, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
        t = torch.randn(*size, generator=g, dtype=torch.float64) * scale + shift
        return t.to(dtype=dtype, device=device)

    s = shape
    if op == "rms_norm":
        return Case(op, (randn(s.batch, s.seq, s.hidden), randn(s.hidden, scale=0.1, shift=1.0)), {"eps": 1e-5}, (0, 1))
    if op == "apply_rotary":
        cos, sin = rope_cos_sin(s.seq, s.head_dim)
        q = randn(s.batch, s.heads, s.seq, s.head_dim)
        k = randn(s.batch, s.kv_heads, s.seq, s.head_dim)
        return Case(op, (q, k, cos.to(dtype=dtype, device=device), sin.to(dtype=dtype, device=device)), {}, (0, 1))
    if op == "swiglu":
        return Case(op, (randn(s.batch, s.seq, s.intermediate), randn(s.batch, s.seq, s.intermediate)), {}, (0, 1))
    if op == "attention":
        q = randn(s.batch, s.heads, s.seq, s.head_dim)
        k = randn(s.batch, s.kv_heads, s.seq, s.head_dim)
        v = randn(s.batch, s.kv_heads, s.seq, s.head_dim)
        return Case(op, (q, k, v), {"causal": True, "window": s.window}, (0, 1, 2))
    if op == "attention_block":  # a ring's diagonal block of packed rows: causal, three documents, tiled rows
        q = randn(s.batch, s.heads, s.seq, s.head_dim)
        k = randn(s.batch, s.kv_heads, s.seq, s.head_dim)
        v = randn(s.batch, s.kv_heads, s.seq, s.head_dim)
        segs = (torch.arange(s.seq) * 3 // s.seq).expand(s.batch, -1).to(device)
        tile = max(1, s.seq // 3)
        return Case(op, (q, k, v), {"causal": True, "seg_q": segs, "seg_k": segs, "tile": tile}, (0, 1, 2))
    if op == "cross_entropy":
        n = s.batch * s.seq
        hidden = randn(n, s.hidden)
        weight = randn(s.vocab, s.hidden, scale=1.0 / math.sqrt(s.hidden))
        targets = torch.randint(0, s.vocab, (n,), generator=g)
        targets[:: max(2, n // 5)] = -100  # a few ignored positions (padding / masked prompt)
        # Several chunks, the last one partial, so the chunking itself is exercised.
        chunk = max(1, math.ceil(n / 3) + 1) if n <= 16384 else None
        return Case(op, (hidden, weight, targets.to(device)), {"chunk_size": chunk}, (0, 1))
    if op == "expert_mlp":  # 4 experts, one of them given no row
        n, h, i = s.batch * s.seq, s.hidden, s.intermediate
        counts = torch.tensor([n // 2, 0, n // 4, n - n // 2 - n // 4])
        gate_up = randn(4, 2 * i, h, scale=1.0 / math.sqrt(h))
        down = randn(4, h, i, scale=1.0 / math.sqrt(i))
        return Case(op, (randn(n, h), counts.to(device), gate_up, down), {}, (0, 2, 3))
    raise KeyError(f"unknown op {op!r}")


def truth_fn(op: str) -> Callable:
    """The definition each backend is compared with (run in fp64 on the CPU)."""
    if op == "cross_entropy":
        return lambda h, w, t, chunk_size=None: reference.plain_cross_entropy(h, w, t)
    return getattr(reference, op)
