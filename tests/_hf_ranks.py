"""The ranks of tests/models/test_hf.py (``main`` on forked local ranks, or this file under torchrun):
build each family's model under 4-rank layouts, save what each rank holds.

    torchrun --nproc_per_node 4 tests/_hf_ranks.py OUT HF_DIR [HF_DIR ...]

For each HF_DIR (a family's tiny model, written by transformers) and each layout (FSDP2 x TP2, with and without
sequence parallel; PP2 x FSDP2; for a mixture of experts EP2 x FSDP2 over 4, and EP2 with attention under TP2 + SP)
it builds the model twice, seeded from the family's tiny preset and from HF_DIR (``model.init_from``), and
saves to OUT/<family>-<layout>-<init|hf>-rank<R>.pt the full value of every parameter this rank's stage holds
(gathered over its data/tensor-parallel peers); for the HF build without a pipeline also the logits of a fixed
batch, and the losses and final parameters of SGD_STEPS steps of plain SGD on fixed batches (each data-parallel
rank its half), which one process must reproduce.
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from canntrain_core.families import FAMILIES
from canntrain_core.models.lifecycle import build_training_model
from canntrain_core.models.registry import model_config
from canntrain_core.recipe import load_recipe
from canntrain_core.runtime.distributed import ParallelDims, dp_coordinates
from canntrain_core.sizing.layout import Layout, layout_problems
from canntrain_core.sizing.shapes import shape_of

LAYOUTS = {
    "fsdp2_tp2": {
        "distributed.data_parallel_size": 2,
        "distributed.zero_optimization": 3,
        "distributed.tensor_parallel_size": 2,
    },
    "fsdp2_tp2_sp": {
        "distributed.data_parallel_size": 2,
        "distributed.zero_optimization": 3,
        "distributed.tensor_parallel_size": 2,
        "distributed.sequence_parallel": True,
    },
    # a mixture of experts: experts over ep 2, each rank's half of them and the rest sharded by FSDP2 over 4
    "ep2_fsdp2": {
        "distributed.data_parallel_size": 4,
        "distributed.zero_optimization": 3,
        "distributed.expert_parallel_size": 2,
    },
    # and with attention split over tp 2 under sequence parallel (the MoE block whole on each tp rank)
    "ep2_tp2_sp": {
        "distributed.data_parallel_size": 2,
        "distributed.zero_optimization": 3,
        "distributed.expert_parallel_size": 2,
        "distributed.tensor_parallel_size": 2,
        "distributed.sequence_parallel": True,
    },
    "pp2_fsdp2": {
        "distributed.data_parallel_size": 2,
        "distributed.zero_optimization": 3,
        "distributed.pipeline_parallel_size": 2,
        "optim.grad_accum_steps": 2,
    },
}
SGD_STEPS, SGD_LR = 3, 0.5


def sgd_batches(vocab: int) -> list[torch.Tensor]:
    """The fixed batches of the SGD steps: 4 rows of 17 tokens each (inputs and next-token targets)."""
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (4, 17), generator=g) for _ in range(SGD_STEPS)]


def full(p: torch.Tensor) -> torch.Tensor:
    return (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()


def main(out: str, *hf_dirs: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    for hf_dir in hf_dirs:
        hf_config = model_config(load_recipe(None, {"model.init_from": hf_dir}).model)
        family = next(f for f in FAMILIES.values() if hf_config.model_type in f.model_types)
        for name, layout in LAYOUTS.items():
            if name.startswith("ep2") != bool(family.router_class) and name != "pp2_fsdp2":
                continue  # a mixture of experts runs its own layouts (TP with EP: ep2_tp2_sp)
            for source in ("init", "hf"):
                extra = (
                    {"model.init_from": hf_dir}
                    if source == "hf"
                    else {"model.preset": family.tiny, "model.overrides": {"vocab_size": 300}}
                )
                recipe = load_recipe(None, {"distributed.world_size": 4, "experiment.seed": 7, **layout, **extra})
                refused = layout_problems(Layout.from_recipe(recipe), shape_of(model_config(recipe.model)))
                if refused:  # a tied preset under pipeline parallel, a mixture of experts under TP: as the trainer
                    if rank == 0:
                        (Path(out) / f"{family.name}-{name}-{source}-refused.txt").write_text("; ".join(refused))
                    continue
                dims = ParallelDims.from_recipe(recipe)
                mesh = dims.build_mesh("cpu")
                built = build_training_model(recipe, model_config(recipe.model), torch.device("cpu"), mesh, dims)
                model = built.model
                saved = {"params": {n: full(p) for n, p in model.named_parameters()}}
                if source == "hf" and built.schedule is None:
                    with torch.no_grad():
                        saved["logits"] = model(ids)
                    saved["loaded"] = built.loaded
                    dp_rank, dp_size = dp_coordinates(mesh, dims)
                    opt = torch.optim.SGD(model.parameters(), lr=SGD_LR)
                    losses = []
                    for batch in sgd_batches(hf_config.vocab_size):
                        mine = batch.chunk(dp_size)[dp_rank]
                        loss = model(mine[:, :-1], mine[:, 1:])
                        loss.backward()
                        opt.step()
                        opt.zero_grad()
                        mean = loss.detach().clone()
                        dist.all_reduce(mean)
                        losses.append(mean.item() / dist.get_world_size())  # tp peers hold the same loss
                    saved["sgd_losses"] = losses
                    saved["sgd_params"] = {n: full(p) for n, p in model.named_parameters()}
                torch.save(saved, Path(out) / f"{family.name}-{name}-{source}-rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
