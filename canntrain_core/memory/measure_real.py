"""Real peak memory of a few training steps on the device at hand (small models only).

On CUDA / NPU this is ``max_memory_allocated`` (tensors only, comparable with the estimate's
tracked total); on the CPU it is the process's peak resident set size, which also counts the Python
interpreter and torch's libraries, so there it is an upper bound, not a check.
"""

from __future__ import annotations

import contextlib

import torch

from canntrain_core.models.lifecycle import build_training_model
from canntrain_core.models.registry import build_config
from canntrain_core.recipe import load_recipe
from canntrain_core.runtime.accelerator import get_accelerator
from canntrain_core.sizing.setup import TrainSetup
from canntrain_core.sizing.shapes import ModelShape, rebuild_recipe


def measure_real(shape: ModelShape, s: TrainSetup, steps: int = 2, device: str | None = None) -> dict[str, object]:
    """Run ``steps`` single-device steps for real; return {"device", "peak_bytes", "kind"}."""
    if s.world_size != 1:
        raise NotImplementedError("measure_real runs one device; use measure_fake for sharded layouts")
    if shape.num_params() > 2e9:
        raise ValueError(f"measure_real: {shape.num_params() / 1e9:.1f} B parameters is not a small model")
    acc = get_accelerator(device)
    recipe = load_recipe(
        None,
        {
            **rebuild_recipe(shape),
            "model.precision": s.precision,
            "model.activation_checkpointing": s.recompute,
        },
    )
    model = build_training_model(recipe, build_config(recipe.model.preset, recipe.model.overrides), acc.device).model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    ids = torch.randint(0, shape.vocab_size, (s.micro_batch, s.seq_length), device=acc.device)
    amp = acc.autocast(s.precision) if s.precision != "fp32" else contextlib.nullcontext()
    acc.reset_peak_memory()
    for _ in range(steps):
        for _ in range(s.grad_accum):
            with amp:
                loss = model(ids, ids)
            loss.backward()
        opt.step()
        opt.zero_grad()
    acc.synchronize()
    kind = "max_memory_allocated" if acc.type != "cpu" else "peak RSS (whole process)"
    return {"device": acc.name(), "peak_bytes": acc.peak_memory_bytes(), "kind": kind}
