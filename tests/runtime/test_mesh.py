"""Layout validation and the rank map shown in the mesh notebook, against a real DeviceMesh."""

import pytest

from canntrain_core.memory.measure import fake_world
from canntrain_core.models import build_config
from canntrain_core.recipe import RecipeError, load_recipe
from canntrain_core.runtime.distributed import ParallelDims, rank_coordinates
from canntrain_core.sizing.layout import check_layout


def test_rank_coordinates_match_init_device_mesh():
    dims = ParallelDims(pp=2, dp_replicate=1, dp_shard=2, cp=1, tp=4)
    with fake_world(dims.world_size):
        mesh = dims.build_mesh("cpu")
        assert mesh.mesh_dim_names == ("pp", "dp_shard", "tp")
        layout = mesh.mesh.tolist()
    for c in rank_coordinates(dims):
        assert layout[c["pp"]][c["dp_shard"]][c["tp"]] == c["rank"]


def test_zero_stage_picks_shard_or_replicate():
    d = load_recipe(None, {"distributed.world_size": 4, "distributed.data_parallel_size": 4})
    assert ParallelDims.from_recipe(d) == ParallelDims(pp=1, dp_replicate=4, dp_shard=1, cp=1, tp=1)
    d = load_recipe(
        None, {"distributed.world_size": 4, "distributed.data_parallel_size": 4, "distributed.zero_optimization": 3}
    )
    assert ParallelDims.from_recipe(d).dp_shard == 4


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            {"distributed.world_size": 8, "distributed.tensor_parallel_size": 8},
            "tensor_parallel_size=8 must divide the model's 4 attention heads",
        ),
        (
            {"distributed.world_size": 8, "distributed.pipeline_parallel_size": 8, "optim.grad_accum_steps": 8},
            "pipeline_parallel_size=8 exceeds the model's 4 layers",
        ),
        (
            {"distributed.world_size": 2, "distributed.pipeline_parallel_size": 2},
            "pipeline_parallel_size=2 needs at least 2 micro-batches per step, got 1",
        ),
        ({"optim.offload_optimizer": True}, "optim.offload_optimizer needs FSDP2"),
        (
            {"distributed.world_size": 4, "distributed.tensor_parallel_size": 2, "distributed.data_parallel_size": 2},
            "zero_optimization=0 (DDP) with tensor or pipeline parallel is not supported",
        ),
        (
            {"distributed.world_size": 2, "distributed.context_parallel_size": 2},
            "context_parallel_size=2 needs zero_optimization >= 1",
        ),
        (
            {
                "distributed.world_size": 4,
                "distributed.context_parallel_size": 2,
                "distributed.expert_parallel_size": 2,
                "distributed.data_parallel_size": 2,
                "distributed.zero_optimization": 3,
            },
            "context_parallel_size=2 with distributed.expert_parallel_size > 1 is not supported yet",
        ),
        (
            {
                "distributed.world_size": 4,
                "distributed.tensor_parallel_size": 2,
                "distributed.pipeline_parallel_size": 2,
                "distributed.sequence_parallel": True,
            },
            "sequence_parallel with pipeline_parallel_size > 1",
        ),
    ],
)
def test_invalid_layouts_name_the_key(overrides, message):
    # what needs no model is refused by load_recipe already, the rest by the trainer's check
    with pytest.raises(RecipeError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_layout(load_recipe(None, overrides), build_config("tiny"))


def test_tp_across_nodes_needs_consent():
    recipe = load_recipe(
        None,
        {
            "model.preset": "llama2-70b",
            "distributed.world_size": 16,
            "distributed.tensor_parallel_size": 16,
            "distributed.zero_optimization": 1,
        },
    )
    with pytest.raises(RecipeError, match="spans nodes of 8 devices"):
        check_layout(recipe, build_config("llama2-70b"), devices_per_node=8)
    recipe.distributed.allow_cross_node_tp = True
    with pytest.raises(RecipeError, match="must divide the model's 8 KV heads"):
        check_layout(recipe, build_config("llama2-70b"), devices_per_node=8)


def test_world_size_must_match_the_launch(monkeypatch):
    from canntrain_core.runtime import get_accelerator
    from canntrain_core.runtime.distributed import init_distributed

    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(RecipeError, match=r"distributed.world_size=1 but this job has 4 process\(es\)"):
        init_distributed(get_accelerator("cpu"), load_recipe(None).distributed)
