"""Torchrun target for tests/test_hf.py: build the model under 4-rank layouts and save what each rank holds.

    torchrun --nproc_per_node 4 tests/_hf_ranks.py HF_DIR OUT

For each layout (FSDP2 x TP2; PP2 x FSDP2) it builds the model twice, seeded and from HF_DIR
(``model.init_from``), and saves to OUT/<layout>-<init|hf>-rank<R>.pt the full value of every
parameter this rank's stage holds (gathered over its data/tensor-parallel peers), and for the HF
build the logits of a fixed batch on the last stage.
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from canntrain_core.models.lifecycle import build_training_model
from canntrain_core.models.registry import model_config
from canntrain_core.recipe import load_recipe
from canntrain_core.runtime.distributed import ParallelDims

LAYOUTS = {
    "fsdp2_tp2": {
        "distributed.data_parallel_size": 2,
        "distributed.zero_optimization": 3,
        "distributed.tensor_parallel_size": 2,
    },
    "pp2_fsdp2": {
        "distributed.data_parallel_size": 2,
        "distributed.zero_optimization": 3,
        "distributed.pipeline_parallel_size": 2,
        "optim.grad_accum_steps": 2,
    },
}


def main(hf_dir: str, out: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    for name, layout in LAYOUTS.items():
        for source in ("init", "hf"):
            extra = {"model.init_from": hf_dir} if source == "hf" else {"model.overrides": {"vocab_size": 300}}
            recipe = load_recipe(None, {"distributed.world_size": 4, "experiment.seed": 7, **layout, **extra})
            dims = ParallelDims.from_recipe(recipe.distributed)
            mesh = dims.build_mesh("cpu")
            built = build_training_model(recipe, model_config(recipe.model), torch.device("cpu"), mesh, dims)
            full = {
                n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                for n, p in built.model.named_parameters()
            }
            saved = {"params": full}
            if source == "hf" and built.schedule is None:
                with torch.no_grad():
                    saved["logits"] = built.model(ids)
                saved["loaded"] = built.loaded
            torch.save(saved, Path(out) / f"{name}-{source}-rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
