"""Tokens/s of whole training steps with a ``model.kernels`` choice (the fused-kernels notebook and
benchmarks/kernel_speed.py compare eager with auto)."""

from __future__ import annotations

import time

import torch

from canntrain_core.models.fused import select_kernels
from canntrain_core.models.lifecycle import build_training_model
from canntrain_core.models.registry import model_config
from canntrain_core.recipe import load_recipe
from canntrain_core.runtime import get_accelerator


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
    acc = get_accelerator()
    recipe = load_recipe(
        None,
        {
            "model.preset": preset,
            "model.overrides": overrides or {},
            "model.kernels": kernels,
            "model.precision": precision,
            "experiment.seed": seed,
        },
    )
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
