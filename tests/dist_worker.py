"""Runs several parallel layouts in one torchrun launch (imports cost seconds per process).

    python -m torch.distributed.run --standalone --nproc_per_node N tests/dist_worker.py OUT CACHE LAYOUT...

Each LAYOUT is a name from LAYOUTS; its run directory is OUT/LAYOUT. A layout named
`NAME@STEP` stops after STEP steps; `NAME<PATH` resumes from the checkpoint PATH.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from conftest import FAST, TINY  # noqa: E402

from canntrain_core.recipe import load_recipe  # noqa: E402
from canntrain_core.train.trainer import Trainer  # noqa: E402

# Every layout trains on global batches of 8 sequences, like the single-process reference.
BASE = {**FAST, "optim.max_steps": 8, "logging.eval_interval": 4, "logging.ckpt_interval": 100}
LAYOUTS = {
    "single": {"data.batch_size": 8},
    "dp2": {"distributed.data_parallel_size": 2, "data.batch_size": 4},
    "fsdp2": {"distributed.data_parallel_size": 2, "distributed.zero_optimization": 3, "data.batch_size": 4},
    "zero2_2": {"distributed.data_parallel_size": 2, "distributed.zero_optimization": 2, "data.batch_size": 4},
    "tp2": {"distributed.tensor_parallel_size": 2, "data.batch_size": 8},
    "pp2_gpipe": {"distributed.pipeline_parallel_size": 2, "distributed.pipeline_schedule": "gpipe",
                  "data.batch_size": 4, "optim.grad_accum_steps": 2},
    "pp2_1f1b": {"distributed.pipeline_parallel_size": 2, "distributed.pipeline_schedule": "1f1b",
                 "data.batch_size": 4, "optim.grad_accum_steps": 2},
    "fsdp2_tp2": {"distributed.data_parallel_size": 2, "distributed.zero_optimization": 3,
                  "distributed.tensor_parallel_size": 2, "data.batch_size": 4},
    "fsdp4": {"distributed.data_parallel_size": 4, "distributed.zero_optimization": 3, "data.batch_size": 2},
}


def recipe_for(layout: str, cache: str, world: int):
    return load_recipe(TINY, {**BASE, "data.cache_dir": cache, "distributed.world_size": world, **LAYOUTS[layout]})


def main(out: str, cache: str, *layouts: str) -> None:
    import torch.distributed as dist

    for spec in layouts:
        stop = resume = None
        name = spec
        if "@" in spec:
            name, stop = spec.split("@")
        if "<" in name:
            name, resume = name.split("<")
        import os

        world = int(os.environ.get("WORLD_SIZE", "1"))
        run_dir = Path(out) / (spec.replace("<", "_from_").replace("/", "_").replace("@", "_at_") if resume else name)
        trainer = Trainer(recipe_for(name, cache, world), run_dir=run_dir, resume_from=resume, progress=False)
        trainer.fit(stop_after=int(stop) if stop else None)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
