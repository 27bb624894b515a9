"""What to tell the user when a real run runs out of device memory.

The trainer (canntrain_core/train/) catches the out-of-memory error and calls :func:`oom_hint`
with the recipe, the model config it built and the device's capacity; the hint shows the estimate next
to the capacity and the cheapest change that the estimator says would fit.
"""

from __future__ import annotations

from typing import Any

from canntrain_core.sizing.devices import bytes_text
from canntrain_core.sizing.estimator import estimate
from canntrain_core.sizing.layout import Layout, context_parallel_pays, layout_problems
from canntrain_core.sizing.setup import TrainSetup, setup_from_recipe
from canntrain_core.sizing.shapes import ModelShape, shape_of


def _candidates(s: TrainSetup, shape: ModelShape) -> list[tuple[str, TrainSetup]]:
    """Single-key changes, cheapest (least slowdown) first; each names the recipe key to set."""
    out: list[tuple[str, TrainSetup]] = []
    if s.recompute == "none":
        out.append(("model.activation_checkpointing=selective", s.but(recompute="selective")))
    if s.micro_batch > 1:
        mb = s.micro_batch // 2
        out.append(
            (
                f"data.batch_size={mb} optim.grad_accum_steps={s.grad_accum * 2} (same global batch)",
                s.but(micro_batch=mb, grad_accum=s.grad_accum * 2),
            )
        )
    if s.recompute != "full":
        out.append(("model.activation_checkpointing=full", s.but(recompute="full")))
    if s.dp * s.cp > 1:
        for z in range(s.zero + 1, 4):
            out.append((f"distributed.zero_optimization={z}", s.but(zero=z)))
    if shape.num_experts % (s.ep * 2) == 0 and (s.dp * s.cp) % (s.ep * 2) == 0:  # experts split further
        out.append((f"distributed.expert_parallel_size={s.ep * 2}", s.but(ep=s.ep * 2)))
    f = 2
    while s.dp % f == 0 and context_parallel_pays(s.seq_length, s.cp * f):  # long rows: split them, same batch
        cp = s.but(cp=s.cp * f, dp=s.dp // f, grad_accum=s.grad_accum * f, zero=s.zero or 3)
        out.append(
            (
                f"distributed.context_parallel_size={cp.cp} distributed.data_parallel_size={cp.dp} "
                f"optim.grad_accum_steps={cp.grad_accum}" + ("" if s.zero else " distributed.zero_optimization=3"),
                cp,
            )
        )
        f *= 2
    if s.dp % 2 == 0:
        out.append(
            (
                f"distributed.tensor_parallel_size={s.tp * 2} distributed.data_parallel_size={s.dp // 2}",
                s.but(tp=s.tp * 2, dp=s.dp // 2),
            )
        )
        out.append(
            (
                f"distributed.pipeline_parallel_size={s.pp * 2} distributed.data_parallel_size={s.dp // 2}",
                s.but(pp=s.pp * 2, dp=s.dp // 2),
            )
        )
    if not s.offload_optimizer:
        out.append(("optim.offload_optimizer=true", s.but(offload_optimizer=True)))
    return out


def oom_hint(recipe: Any, capacity_bytes: float, model: Any) -> str:
    """A few lines: estimated peak vs capacity, and the first change (cheapest first) that fits.

    ``model``: the ModelShape, or the transformers config the run built (read by ``shape_of``); a recipe's
    shape without a built model is ``memory.recipe_shape.shape_from_recipe``."""
    shape = model if isinstance(model, ModelShape) else shape_of(model)
    setup = setup_from_recipe(recipe)
    est = estimate(shape, setup)
    lines = [
        f"out of device memory: the estimate for this recipe is {bytes_text(est.total)} per device "
        f"(peak in {est.phase}) against {bytes_text(capacity_bytes)} available"
    ]
    top = sorted(est.categories.items(), key=lambda kv: -kv[1])[:3]
    lines.append("largest parts: " + ", ".join(f"{k} {bytes_text(v)}" for k, v in top))
    for change, cand in _candidates(setup, shape):
        if layout_problems(Layout.from_setup(cand), shape):
            continue  # never suggest what the trainer would refuse (e.g. offload without FSDP2)
        try:
            e2 = estimate(shape, cand)
        except ValueError:
            continue
        if e2.fits(capacity_bytes):
            lines.append(f"try: --set {change}  (estimated {bytes_text(e2.total)})")
            break
    else:
        lines.append("no single change fits; run `canntrain plan` for this model to see layouts that do")
    return "\n".join(lines)
