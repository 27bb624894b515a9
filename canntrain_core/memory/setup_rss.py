"""Host memory of getting a model ready to train, per rank, from process start to the first step.

    python -m torch.distributed.run --standalone --nproc_per_node 4 \\
        -m canntrain_core.memory.setup_rss OUT OVERRIDES_JSON [meta|host]

``meta`` is canntrain's path (``models.lifecycle``: build on meta, shard, each rank fills only its
own shards); ``host`` is the path the trainer took before it: every rank builds the whole model
with transformers on the host, then ``parallelize`` shards it. Each rank writes ``OUT/rank{R}.json``
with its resident memory after the imports (the fixed runtime), its peak after the set-up, and the
bytes of the parameters it holds. ``benchmarks/setup_memory.py`` tabulates them; a test checks the
shape (4 ranks each below half of one process).
"""

from __future__ import annotations

import json
import os
import resource
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from canntrain_core.models.classes import training_class
from canntrain_core.models.lifecycle import build_training_model
from canntrain_core.models.lm import CausalLM
from canntrain_core.models.registry import model_config
from canntrain_core.parallel import parallelize
from canntrain_core.recipe import load_recipe
from canntrain_core.runtime.distributed import ParallelDims
from canntrain_core.train.optim import build_optimizer


def peak_rss_bytes() -> int:
    """This process's peak resident set size so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def rss_bytes() -> int:
    """This process's resident set size now (Linux /proc)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure(out: str | Path, overrides: dict, path: str = "meta") -> dict:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if world > 1 else 0
    recipe = load_recipe(None, {**overrides, "distributed.world_size": world})
    dims = ParallelDims.from_recipe(recipe)
    mesh = dims.build_mesh("cpu")
    config = model_config(recipe.model)
    # Now, not the peak: a first import in a fresh environment (bytecode, transformers' module scan)
    # peaks higher for a moment, and that is not memory a run keeps.
    runtime = rss_bytes()
    if path == "meta":
        model = build_training_model(recipe, config, torch.device("cpu"), mesh, dims).model
    elif path == "host":
        model = CausalLM(training_class(config)(config))
        parallelize(model, mesh, dims, recipe, torch.device("cpu"))
    else:
        raise ValueError(f"path must be 'meta' or 'host', got {path!r}")
    build_optimizer(model, recipe.optim)  # AdamW allocates its states at the first step, after this
    local = sum((p.to_local() if hasattr(p, "to_local") else p).numel() * 4 for p in model.parameters())
    row = {
        "rank": rank,
        "world": world,
        "path": path,
        "runtime_rss": runtime,
        "setup_peak_rss": peak_rss_bytes(),
        "local_param_bytes": local,
        "largest_param_bytes": max(p.numel() * 4 for p in model.parameters()),
    }
    Path(out, f"rank{rank}.json").write_text(json.dumps(row))
    if world > 1:
        dist.destroy_process_group()
    return row


if __name__ == "__main__":
    measure(sys.argv[1], json.loads(sys.argv[2]), *sys.argv[3:])
