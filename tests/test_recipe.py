"""Recipe validation: every bad input is rejected before work starts, naming file, key and line."""

from pathlib import Path

import pytest
import yaml

from canntrain_core.recipe import RecipeError, load_recipe, save_resolved

CONFIGS = Path(__file__).resolve().parents[1] / "cookbook" / "llama" / "configs"


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "recipe.yaml"
    p.write_text(text)
    return p


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_cookbook_recipes_load(path):
    recipe = load_recipe(path)
    d = recipe.distributed
    assert d.tensor_parallel_size * d.pipeline_parallel_size * d.data_parallel_size * d.context_parallel_size == d.world_size


def test_seeds_7b_global_batch_is_derived():
    # The seeds' example: micro-batch 16 x DP 2 x accumulation 4 = 128 sequences.
    recipe = load_recipe(CONFIGS / "7b_pretrain.yaml")
    assert recipe.global_batch_size == 128
    assert recipe.tokens_per_step == 128 * 4096
    assert recipe.derived()["warmup_steps"] == 3000  # 0.03 x 100000


def test_unknown_key_names_file_key_and_line(tmp_path):
    p = write(tmp_path, "optim:\n  lr: 1.0e-3\n  learning_rate: 2.0e-3\n")
    with pytest.raises(RecipeError) as e:
        load_recipe(p)
    msg = str(e.value)
    assert str(p) in msg and "line 3" in msg and "optim.learning_rate" in msg and "unknown key" in msg


def test_wrong_type_names_key_and_value(tmp_path):
    p = write(tmp_path, "data:\n  batch_size: eight\n")
    with pytest.raises(RecipeError) as e:
        load_recipe(p)
    assert "data.batch_size" in str(e.value) and "'eight'" in str(e.value) and "line 2" in str(e.value)


def test_out_of_range_value(tmp_path):
    p = write(tmp_path, "optim:\n  lr: -1\n")
    with pytest.raises(RecipeError, match=r"optim\.lr: Input should be greater than 0"):
        load_recipe(p)


def test_world_size_product_mismatch(tmp_path):
    p = write(tmp_path, "distributed:\n  world_size: 16\n  tensor_parallel_size: 8\n  pipeline_parallel_size: 4\n")
    with pytest.raises(RecipeError) as e:
        load_recipe(p)
    assert "distributed" in str(e.value) and "world_size=16" in str(e.value) and "= 32" in str(e.value)


def test_yaml_syntax_error_gives_line(tmp_path):
    p = write(tmp_path, "optim:\n  lr: 1e-3\n  betas: [0.9, 0.95\nlogging:\n  log_interval: 1\n")
    with pytest.raises(RecipeError) as e:
        load_recipe(p)
    assert "YAML syntax error" in str(e.value) and str(p) in str(e.value)
    assert "line 4" in str(e.value)


def test_missing_file():
    with pytest.raises(RecipeError, match="not found"):
        load_recipe("/nonexistent/recipe.yaml")


def test_overrides_cli_and_papermill_forms_agree():
    cli = load_recipe(CONFIGS / "tiny_pretrain.yaml", ["optim.lr=1e-4", "data.tokenizer.vocab_size=512"])
    pm = load_recipe(CONFIGS / "tiny_pretrain.yaml", {"optim.lr": 1e-4, "data.tokenizer.vocab_size": "512"})
    assert cli.optim.lr == pm.optim.lr == 1e-4
    assert cli.data.tokenizer.vocab_size == pm.data.tokenizer.vocab_size == 512


def test_bad_override_is_named_as_override():
    with pytest.raises(RecipeError) as e:
        load_recipe(CONFIGS / "tiny_pretrain.yaml", ["optim.lrr=1e-4"])
    assert "override: optim.lrr: unknown key" in str(e.value)
    with pytest.raises(RecipeError, match="expected KEY=VALUE"):
        load_recipe(None, ["optim.lr"])


def test_unknown_preset_lists_known_ones():
    with pytest.raises(RecipeError, match=r"model\.preset: unknown preset 'llama9'.*llama2-70b"):
        load_recipe(None, {"model.preset": "llama9"})


def test_zero_optimization_bool_means_stage_3_and_warmup_exclusive():
    assert load_recipe(None, {"distributed.zero_optimization": True}).distributed.zero_optimization == 3
    with pytest.raises(RecipeError, match="warmup_ratio or warmup_steps"):
        load_recipe(None, {"optim.warmup_ratio": 0.1, "optim.warmup_steps": 10})


def test_resolved_recipe_round_trips(tmp_path):
    recipe = load_recipe(CONFIGS / "70b_pretrain.yaml", ["optim.lr=2e-4"])
    out = save_resolved(recipe, tmp_path)
    text = out.read_text()
    assert "# derived" in text and "global_batch_size: 32" in text
    again = load_recipe(out)
    assert again == recipe
    assert yaml.safe_load(text)["optim"]["lr"] == 2e-4
