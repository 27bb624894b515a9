"""Measurements shared by benchmarks/kernels.py and the fused-kernels notebook.

* :func:`backend_speed`: forward+backward time of each backend vs eager, per op and shape.
* :func:`train_step_throughput`: tokens/s of whole training steps of a llama preset with the
  kernels chosen by a ``model.kernels`` setting (e.g. eager vs auto).
* :func:`cross_entropy_peak`: peak memory of the chunked vs the plain cross-entropy, fwd+bwd.
"""

from __future__ import annotations

import time
from typing import Sequence

import torch

from canntrain_kernels import registry
from canntrain_kernels.cases import make_case, parse_dtype, parse_shape
from canntrain_kernels.check import time_ms
from canntrain_kernels.memory import peak_bytes


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
                    dict(op=op, shape=shape, dtype=dtype, backend=backend, fwd_ms=fwd, fwd_bwd_ms=fwd_bwd,
                         speedup=(eager_ms / fwd_bwd) if eager_ms else None)
                )
    return rows


def train_step_throughput(
    kernels: str = "eager",
    preset: str = "tiny",
    overrides: dict | None = None,
    batch: int = 8,
    seq: int = 128,
    steps: int = 5,
    warmup: int = 2,
    precision: str = "fp32",
    vocab_size: int | None = None,
    seed: int = 0,
) -> dict:
    """Tokens/s of AdamW training steps (forward, chunked/plain loss, backward, step) on this device.

    The model is built as the trainer builds it (``models.lifecycle``, ``model.kernels`` = ``kernels``:
    eager, auto, compile, ...) and trained on random tokens; the first ``warmup`` steps (compilation)
    are not timed. ``select_s`` is the build, kernel selection included.
    """
    from canntrain_core.models.fused import select_kernels
    from canntrain_core.models.lifecycle import build_training_model
    from canntrain_core.models.registry import model_config
    from canntrain_core.recipe import load_recipe
    from canntrain_core.runtime import get_accelerator

    acc = get_accelerator()
    recipe = load_recipe(None, {"model.preset": preset, "model.overrides": overrides or {}, "model.kernels": kernels,
                                "model.precision": precision, "experiment.seed": seed})
    config = model_config(recipe.model, vocab_size or recipe.data.tokenizer.vocab_size)
    t0 = time.perf_counter()
    model = build_training_model(recipe, config, acc.device).model  # the trainer's model, kernels wired in
    select_s = time.perf_counter() - t0
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    vocab = config.vocab_size
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq + 1), generator=g).to(acc.device)
    times = []
    first_s = None
    for i in range(warmup + steps):
        acc.synchronize()
        t = time.perf_counter()
        with acc.autocast(precision):
            loss = model(ids[:, :-1], ids[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        acc.synchronize()
        dt = time.perf_counter() - t
        if i == 0:
            first_s = dt
        if i >= warmup:
            times.append(dt)
    step_s = sorted(times)[len(times) // 2]
    return dict(
        kernels=kernels,
        backends={op: sel.backend for op, sel in select_kernels(recipe.model, acc.type).items()},
        tokens_per_s=batch * seq / step_s,
        step_ms=step_s * 1e3,
        first_step_s=first_s,
        select_s=select_s,
        loss=loss.item(),
    )


def cross_entropy_peak(
    n: int = 4096, hidden: int = 128, vocab: int = 4096, chunk_size: int | None = None, dtype: str = "fp32",
    device: str | None = None,
) -> dict:
    """Peak bytes of forward+backward of the plain and the chunked cross-entropy on the same inputs."""
    from canntrain_kernels.reference import cross_entropy, plain_cross_entropy

    device = device or registry.current_device()
    shape = parse_shape(f"small:batch=1:seq={n}:hidden={hidden}:vocab={vocab}")
    h, w, t = make_case("cross_entropy", shape, parse_dtype(dtype), device).args

    def step(fn, **kw):
        a, b = h.clone().requires_grad_(), w.clone().requires_grad_()
        return lambda: fn(a, b, t, **kw).backward()

    plain = peak_bytes(step(plain_cross_entropy), device)
    chunked = peak_bytes(step(cross_entropy, chunk_size=chunk_size), device)
    return dict(n=n, hidden=hidden, vocab=vocab, dtype=dtype, logits_bytes=n * vocab * 4,
                plain_bytes=plain, chunked_bytes=chunked, ratio=plain / max(chunked, 1))
