"""Measured memory: one real training step of the actual model code, under FakeTensorMode.

No hardware is needed: tensors carry shapes and dtypes but no data, and
``torch.distributed._tools.mem_tracker.MemTracker`` books every allocation by category. Sharded
layouts run on a fake process group of the right world size (this process plays rank 0).

Recipe for a measurement that works with torch 2.13 (checked on this code base):
build the model on ``meta``; apply tensor parallel / FSDP2 *outside* fake mode (they fail inside);
enter ``FakeTensorMode(allow_non_fake_inputs=True)`` and ``model.to_empty(device="cpu")``; use
AdamW with ``foreach=False`` (what the trainer uses; with DTensor parameters ``foreach=True`` also
makes the tracker's optimizer figure wrong). Two steps run and the second is reported, so the
optimizer states exist during forward, as in every step but the first.

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

from canntrain_core.memory.setup import TrainSetup
from canntrain_core.memory.shapes import ModelShape, llama_overrides

_DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


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


def _local_bytes(t: torch.Tensor) -> int:
    if hasattr(t, "to_local"):
        t = t.to_local()
    return t.numel() * t.element_size()


@contextlib.contextmanager
def fake_world(world_size: int) -> Iterator[None]:
    """A fake process group of ``world_size`` ranks for the duration of the block (rank 0 is us)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

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


class _LossModule(torch.nn.Module):
    """The training step's forward (model + canntrain's loss) as one module, so FSDP2's root hooks
    gather the embedding, final norm and output projection (the loss reads lm_head.weight directly)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        from canntrain_core.models.lm import causal_lm_loss

        return causal_lm_loss(self.model, ids, ids)


def _parallelize(model: torch.nn.Module, s: TrainSetup) -> None:
    """TP (Megatron layout: q/k/v/gate/up column-wise, o/down row-wise), then FSDP2 per block."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (s.dp, s.tp), mesh_dim_names=("dp", "tp"))
    if s.tp > 1:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        plan = {f"self_attn.{n}": ColwiseParallel() for n in ("q_proj", "k_proj", "v_proj")}
        plan.update({"self_attn.o_proj": RowwiseParallel(), "mlp.gate_proj": ColwiseParallel(),
                     "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel()})
        for layer in model.model.model.layers:
            parallelize_module(layer, mesh["tp"], plan)
    if s.zero >= 3 and s.dp > 1:
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.model.layers:
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])


def _check_supported(s: TrainSetup) -> None:
    problems = []
    if s.pp > 1 or s.cp > 1 or s.ep > 1:
        problems.append("pipeline/context/expert parallel (pp, cp, ep must be 1)")
    if s.zero in (1, 2) and s.dp > 1:
        problems.append("ZeRO stage 1/2 (use zero=3, i.e. FSDP2, or zero=0)")
    if s.tp > 1 and (s.sequence_parallel or s.vocab_parallel):
        problems.append("sequence/vocab parallel (set sequence_parallel=False, vocab_parallel=False for tp)")
    if s.recompute == "selective" or s.weights != "amp" or s.lora is not None or s.offload_optimizer:
        problems.append("selective recompute, half weights, LoRA and offload")
    if s.dp > 1 and s.zero == 0:
        problems.append("plain DDP over a fake group (use zero=3)")
    if problems:
        raise NotImplementedError("measure_fake does not cover " + "; ".join(problems) + " — analytic estimate only")


def measure_fake(shape: ModelShape, s: TrainSetup, steps: int = 2) -> Measurement:
    """Run ``steps`` training steps of the llama model of ``shape`` under FakeTensorMode; report the last.

    Covers tp (without sequence parallel), FSDP2 (zero=3) over dp, full recompute, fp32/bf16/fp16
    autocast, and gradient accumulation. Raises NotImplementedError for what it does not cover.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    from canntrain_core.models.registry import build_model

    _check_supported(s)
    t0 = time.perf_counter()
    with fake_world(s.world_size):
        model = build_model("tiny", llama_overrides(shape), device="meta")
        if s.recompute == "full":
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

            for k, layer in enumerate(model.model.layers):
                model.model.layers[k] = checkpoint_wrapper(layer)
        model = _LossModule(model)
        if s.world_size > 1:
            _parallelize(model, s)
        with FakeTensorMode(allow_non_fake_inputs=True):
            model.to_empty(device="cpu")
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
            ids = torch.randint(0, shape.vocab_size, (s.micro_batch, s.seq_length))
            amp = (torch.autocast("cpu", dtype=_DTYPE[s.precision]) if s.precision != "fp32"
                   else contextlib.nullcontext())
            tracker = MemTracker()
            tracker.track_external(model, opt)
            with tracker, warnings.catch_warnings():
                # Under activation recompute a layer's forward runs again inside backward; the tracker
                # sees a forward nested in backward and hooks of modules it no longer references, and
                # says so. Its byte counts stay right (benchmarks/memory_fake_vs_analytic.py): nothing to act on.
                warnings.filterwarnings("ignore", message="Module is None. Skipping", category=UserWarning)
                warnings.filterwarnings("ignore", message="The module hierarchy tracking", category=UserWarning)
                for _ in range(steps):
                    for _ in range(s.grad_accum):
                        with amp:
                            loss = model(ids)
                        loss.backward()
                        tracker.reset_mod_stats()  # the tracker's module stats cover one pass
                    grads = sum(_local_bytes(p.grad) for p in model.parameters() if p.grad is not None)
                    opt.step()
                    opt.zero_grad()
                    tracker.reset_mod_stats()
            peak = tracker.get_tracker_snapshot("peak")
            raw = {(k.value if hasattr(k, "value") else str(k)): v for k, v in next(iter(peak.values())).items()}
            params = sum(_local_bytes(p) for p in model.parameters())  # buffers (rope inv_freq) are tiny
            states = _opt_bytes(opt)
    seconds = time.perf_counter() - t0
    model_states = {"parameters": params, "gradients": grads, "optimizer_states": states}
    return Measurement(_categorize(raw, params, grads, states), raw["Total"], seconds, model_states, raw)


def _opt_bytes(opt: torch.optim.Optimizer) -> int:
    return sum(_local_bytes(v) for st in opt.state.values() for v in st.values()
               if isinstance(v, torch.Tensor) and v.dim() > 0)


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
