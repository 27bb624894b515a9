"""Pipeline parallelism with torch.distributed.pipelining: split the layers into stages.

Stage i keeps a contiguous run of decoder layers (a ModuleDict keyed by the original index, so
parameter names match every other layout); stage 0 also keeps the embedding, the last stage the
final norm and head. The schedule (GPipe or 1F1B) splits each step's batch into micro-batches
and averages their gradients (scale_grads), so a step equals gradient accumulation.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


def stage_layer_ranges(num_layers: int, stages: int) -> list[range]:
    """Contiguous layer ranges, the first stages taking one extra layer when it does not divide."""
    base, extra = divmod(num_layers, stages)
    ranges, start = [], 0
    for i in range(stages):
        end = start + base + (1 if i < extra else 0)
        ranges.append(range(start, end))
        start = end
    return ranges


def split_stage(model, stage: int, stages: int) -> None:
    """Strip ``model`` (a CausalLM) down to pipeline stage ``stage`` in place."""
    keep = stage_layer_ranges(model.config.num_hidden_layers, stages)[stage]
    model.model.layers = nn.ModuleDict({str(i): model.model.layers[i] for i in keep})
    if stage > 0:
        model.model.embed_tokens = None
        if hasattr(model.model, "embed_positions"):  # GPT-2's learned positions go with the embedding
            model.model.embed_positions = None
    if stage < stages - 1:
        model.model.norm = None
        model.lm_head = None
    else:
        model.pipeline_last_stage = True  # its forward returns hidden states; the schedule's loss is head_loss


def build_schedule(model, pp_mesh: DeviceMesh, device: torch.device, schedule: str, microbatches: int):
    stage = PipelineStage(model, pp_mesh.get_local_rank(), pp_mesh.size(), device, group=pp_mesh.get_group())
    # The same loss (and cross-entropy kernel) as without a pipeline: the chunked one never builds
    # the full logits, which on the last stage are its largest activation.
    return SCHEDULES[schedule](stage, n_microbatches=microbatches, loss_fn=model.head_loss)
