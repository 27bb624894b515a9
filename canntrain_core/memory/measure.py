"""Measured memory: one real training step of the actual model code, under FakeTensorMode.

No hardware is needed: tensors carry shapes and dtypes but no data, and
``torch.distributed._tools.mem_tracker.MemTracker`` books every allocation by category. Sharded
layouts run on a fake process group of the right world size (this process plays rank 0).

Recipe for a measurement that works with torch 2.13 (checked on this code base):
build the model on ``meta`` and parallelize it with the trainer's own code (``models.lifecycle
.build_meta_model``) *outside* fake mode (TP and FSDP2 fail inside);
enter ``FakeTensorMode(allow_non_fake_inputs=True)`` and ``model.to_empty(device="cpu")``; use
AdamW with ``foreach=False`` (what the trainer uses; with DTensor parameters ``foreach=True`` also
makes the tracker's optimizer figure wrong). One step runs before the tracker starts (it fills DTensor's
sharding cache, whose first run of each op allocates global-shape fake tensors, and creates the optimizer
states, which exist during forward in every step but a run's first); the tracker's peak covers the steps after.

The tracker books the optimizer's temporaries under "Optstate" and autocast's 16-bit weight copies
under "Activation"; :func:`measure_fake` separates both: optimizer states are read from the
optimizer itself, and the copies are counted from the weights.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from dataclasses import dataclass, field
from typing import Iterator

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker
from torch.testing._internal.distributed.fake_pg import FakeStore

from canntrain_core.models.lifecycle import build_meta_model, tie_head
from canntrain_core.models.registry import build_config
from canntrain_core.parallel.data_parallel import sync_gradients
from canntrain_core.recipe import load_recipe
from canntrain_core.runtime.accelerator import DTYPES
from canntrain_core.runtime.distributed import ParallelDims
from canntrain_core.sizing.setup import TrainSetup
from canntrain_core.sizing.shapes import ModelShape, rebuild_recipe


@dataclass
class Measurement:
    """Peak bytes per category of rank 0, from the tracker, plus the model states read off the tensors."""

    categories: dict[str, int]
    peak: int
    seconds: float
    states: dict[str, int] = field(default_factory=dict)  # params, grads, optimizer states of one step
    raw_peak: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def model_states(self) -> int:
        """Parameters + all gradients + optimizer states, read off the tensors (not at-peak figures)."""
        return sum(self.states.values())


def local_bytes(t: torch.Tensor) -> int:
    if hasattr(t, "to_local"):
        t = t.to_local()
    return t.numel() * t.element_size()


@contextlib.contextmanager
def fake_world(world_size: int) -> Iterator[None]:
    """A fake process group of ``world_size`` ranks for the duration of the block (rank 0 is us)."""
    if world_size == 1:
        yield
        return
    if dist.is_initialized():
        raise RuntimeError("measure: a process group is already initialised; measure in a fresh process")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def recipe_for(shape: ModelShape, s: TrainSetup):
    """The recipe that trains ``shape`` as ``s`` lays it out (what measure_fake hands to parallelize; the planner's
    tests hand it to the validator, pipelines and experts included)."""
    pipeline = {"distributed.pipeline_schedule": s.pipeline_schedule}
    if s.num_microbatches is not None:
        pipeline["distributed.num_microbatches"] = s.num_microbatches
    return load_recipe(
        None,
        {
            **(pipeline if s.pp > 1 else {}),
            **rebuild_recipe(shape),
            "model.precision": s.precision,
            "model.activation_checkpointing": s.recompute,
            "data.batch_size": s.micro_batch,
            "data.seq_length": s.seq_length,
            "optim.grad_accum_steps": s.grad_accum,
            "distributed.world_size": s.world_size,
            "distributed.tensor_parallel_size": s.tp,
            "distributed.data_parallel_size": s.dp,
            "distributed.context_parallel_size": s.cp,
            "distributed.pipeline_parallel_size": s.pp,
            "distributed.expert_parallel_size": s.ep,
            "distributed.zero_optimization": s.zero,
            "distributed.sequence_parallel": s.tp > 1 and s.sequence_parallel,
            "distributed.vocab_parallel": s.vocab_parallel,
        },
    )


def _check_supported(shape: ModelShape, s: TrainSetup) -> None:
    problems = []
    if shape.kind == "moe" and not s.fsdp_mixed_precision:
        # transformers' experts run torch's grouped_mm, whose fake-tensor kernel accepts bf16 operands only
        problems.append("a mixture of experts without 16-bit weights (measure it under FSDP2, zero=3, bf16)")
    if s.pp > 1 or s.ep > 1:
        problems.append("pipeline/expert parallel (pp, ep must be 1)")
    if s.weights != "amp" or s.offload_optimizer:
        problems.append("half weights and offload")
    if s.lora is not None and s.lora.base_bits == 4:
        problems.append("a 4-bit LoRA base (bitsandbytes' kernels take no fake tensors)")
    if s.lora is not None and s.world_size > 1:
        # torch's MemTracker hooks the gradient of every parameter FSDP2 gathers, and a frozen one has none
        problems.append("LoRA on more than one rank")
    if s.dp > 1 and s.zero == 0:
        problems.append("plain DDP over a fake group (use zero >= 1)")
    if problems:
        raise NotImplementedError("measure_fake does not cover " + "; ".join(problems) + " — analytic estimate only")


def measure_fake(shape: ModelShape, s: TrainSetup, steps: int = 1) -> Measurement:
    """Run ``steps`` training steps (after an untracked one) of the model of ``shape`` under FakeTensorMode;
    report their peak.

    Covers tp (without sequence parallel), FSDP2 (zero=3) over dp (x cp), context parallel, full recompute,
    fp32/bf16/fp16 autocast, and gradient accumulation. Raises NotImplementedError for what it does not cover.
    """
    _check_supported(shape, s)
    t0 = time.perf_counter()
    recipe = recipe_for(shape, s)
    if s.lora is not None:  # set after validation, which asks for model.init_from: nothing here reads weights
        recipe.lora.enabled, recipe.lora.rank = True, s.lora.rank
        recipe.lora.target_modules, recipe.lora.dropout = list(s.lora.targets), s.lora.dropout
    with fake_world(s.world_size):
        dims = ParallelDims.from_recipe(recipe)
        # the trainer's own build and parallelize, stopped before anything is allocated
        model, _ = build_meta_model(
            recipe,
            build_config(recipe.model.preset, recipe.model.overrides),
            torch.device("cpu"),
            dims.build_mesh("cpu"),
            dims,
        )
        with FakeTensorMode(allow_non_fake_inputs=True):
            model.to_empty(device="cpu")
            tie_head(model, model.config)  # as the trainer does: a tied head is the embedding
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
            ids = torch.randint(0, shape.vocab_size, (s.micro_batch, s.seq_length))
            args, kwargs = (ids, ids), {}
            if model.context_parallel is not None:  # this rank's slices: ring attention's sends go to the fake group
                x, t, pos, _ = model.context_parallel.split_batch(ids, ids)
                args, kwargs = (x, t), {"position_ids": pos, "context_parallel": True}
            amp = (
                torch.autocast("cpu", dtype=DTYPES[s.precision]) if s.precision != "fp32" else contextlib.nullcontext()
            )

            def train_step(tracker=None):
                for k in range(s.grad_accum):
                    sync_gradients(model, s.zero, last=k == s.grad_accum - 1)  # as the trainer does
                    with amp:
                        loss = model(*args, **kwargs)
                    loss.backward()
                    if tracker:
                        tracker.reset_mod_stats()  # the tracker's module stats cover one pass
                grads = sum(local_bytes(p.grad) for p in model.parameters() if p.grad is not None)
                opt.step()
                opt.zero_grad()
                return grads

            # One step before the tracker: DTensor computes each new op's output metadata by running it on
            # global-shape fake tensors once per process (its sharding cache), which the tracker would book
            # as this rank's memory (5 GiB of "optimizer temporaries" for a vocabulary-sharded 152k head).
            # The optimizer states exist from here on, as in every step but a run's first.
            train_step()
            tracker = _tracker(model, opt)
            with tracker, warnings.catch_warnings():
                # Under activation recompute a layer's forward runs again inside backward; the tracker
                # sees a forward nested in backward and hooks of modules it no longer references, and
                # says so. Its byte counts stay right (benchmarks/memory_fake_vs_analytic.py): nothing to act on.
                warnings.filterwarnings("ignore", message="Module is None. Skipping", category=UserWarning)
                warnings.filterwarnings("ignore", message="The module hierarchy tracking", category=UserWarning)
                for _ in range(steps):
                    grads = train_step(tracker)
                    tracker.reset_mod_stats()
            peak = tracker.get_tracker_snapshot("peak")
            raw = {(k.value if hasattr(k, "value") else str(k)): v for k, v in next(iter(peak.values())).items()}
            params = sum(local_bytes(p) for p in model.parameters())  # buffers (rope inv_freq) are tiny
            states = _opt_bytes(opt)
    seconds = time.perf_counter() - t0
    model_states = {"parameters": params, "gradients": grads, "optimizer_states": states}
    return Measurement(_categorize(raw, params, grads, states), raw["Total"], seconds, model_states, raw)


def _opt_bytes(opt: torch.optim.Optimizer) -> int:
    return sum(
        local_bytes(v) for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor) and v.dim() > 0
    )


def _categorize(raw: dict[str, int], params: int, grads: int, states: int) -> dict[str, int]:
    """Split the tracker's peak snapshot into the estimator's categories.

    Parameters and optimizer states are read off the tensors; if the peak falls in the optimizer
    step, what the tracker books as Optstate beyond the states is the step's temporaries. Gradients
    at the peak are the tracker's Gradient figure plus any gradient still booked as Temp (the
    embedding gradient is created inside backward). Everything else is activations.
    """
    opt_at_peak = raw.get("Optstate", 0)
    temps = max(0, opt_at_peak - states)
    in_step = temps > 2**20  # more than the step counters
    grad_at_peak = raw.get("Gradient", 0)
    temp = raw.get("Temp", 0)
    if in_step:  # all gradients exist in the step; whatever of them the tracker booked as Temp
        moved = min(temp, max(0, grads - grad_at_peak))
        grad_at_peak += moved
        temp -= moved
    return {
        "parameters": raw.get("Parameter", 0) + raw.get("Buffer", 0),
        "gradients": grad_at_peak,
        "optimizer_states": min(opt_at_peak, states),
        "optimizer_step_temporaries": temps,
        "activations": raw.get("Activation", 0) + temp + raw.get("Other", 0),
    }


def measure_trainer_step(trainer) -> Measurement:
    """Peak memory by category of one more real optimizer step of a Trainer's model (any device),
    booked by the same tracker as :func:`measure_fake`: what the notebooks put beside the estimate.

    The step changes the model (and the data position is not advanced): measure after training.
    """
    model, opt = trainer.model, trainer.optimizer
    loader = iter(trainer.data.train_loader())
    batches = [next(loader) for _ in range(trainer.recipe.optim.grad_accum_steps)]
    t0 = time.perf_counter()
    tracker = _tracker(model, opt)
    with tracker, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Module is None. Skipping", category=UserWarning)
        warnings.filterwarnings("ignore", message="The module hierarchy tracking", category=UserWarning)
        trainer.train_step(batches)
        grads = sum(local_bytes(p.grad) for p in model.parameters() if p.grad is not None)
        opt.step()
        opt.zero_grad(set_to_none=True)
    peak = tracker.get_tracker_snapshot("peak")
    raw = {(k.value if hasattr(k, "value") else str(k)): v for k, v in next(iter(peak.values())).items()}
    params = sum(local_bytes(p) for p in model.parameters())
    states = _opt_bytes(opt)
    model_states = {"parameters": params, "gradients": grads, "optimizer_states": states}
    return Measurement(
        _categorize(raw, params, grads, states), raw["Total"], time.perf_counter() - t0, model_states, raw
    )


def _tracker(model, opt):
    """torch's MemTracker over ``model`` and ``opt``. It hooks every parameter's gradient and fails on frozen ones
    (a LoRA base): those get a placeholder instead, which the tracker's own clean-up removes like a hook."""
    tracker = MemTracker()
    for p in model.parameters():
        if not p.requires_grad:
            tracker._param_to_grad_hook_handles[p] = (_NoHook(), _NoHook())
    tracker.track_external(model, opt)
    return tracker


class _NoHook:
    def remove(self) -> None:
        pass
