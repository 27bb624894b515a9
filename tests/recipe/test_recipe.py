"""Recipe validation: every bad input is rejected before work starts, naming file, key and line."""

import os
from pathlib import Path

import pytest
import yaml

from canntrain_core.recipe import RecipeError, load_recipe, save_resolved
from conftest import CONFIGS, ROOT


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "recipe.yaml"
    p.write_text(text)
    return p


@pytest.mark.parametrize("path", sorted(ROOT.glob("cookbook/*/configs/*.yaml")), ids=lambda p: p.name)
def test_cookbook_recipes_load(path):
    recipe = load_recipe(path)
    d = recipe.distributed
    assert (
        d.tensor_parallel_size * d.pipeline_parallel_size * d.data_parallel_size * d.context_parallel_size
        == d.world_size
    )


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
    assert "# derived" in text and "global_batch_size: 128" in text
    again = load_recipe(out)
    assert again == recipe
    assert yaml.safe_load(text)["optim"]["lr"] == 2e-4


def test_duplicate_keys_are_all_reported_with_both_lines(tmp_path):
    p = write(
        tmp_path, "optim:\n  lr: 1.0e-3\n  max_steps: 5\n  lr: 2.0e-3\ndata:\n  seq_length: 8\n  seq_length: 16\n"
    )
    with pytest.raises(RecipeError) as e:
        load_recipe(p)
    msg = str(e.value)
    assert f"{p}, line 4: optim.lr: duplicate key (first at line 2)" in msg
    assert f"{p}, line 7: data.seq_length: duplicate key (first at line 6)" in msg


def test_merge_keys_may_be_overridden(tmp_path):
    p = write(
        tmp_path,
        "experiment:\n  name: base\nmodel:\n  preset: tiny\ndata: &d\n  seq_length: 32\n  batch_size: 2\n"
        "optim:\n  lr: 1.0e-3\nlogging:\n  log_interval: 5\n  <<: {eval_interval: 7, log_interval: 9}\n",
    )
    recipe = load_recipe(p)
    assert recipe.logging.log_interval == 5 and recipe.logging.eval_interval == 7
    # The lines still point where keys are written, not where they were merged from.
    bad = write(tmp_path, "base: &b {seq_length: 32}\ndata:\n  <<: *b\n  seq_length: x\n")
    with pytest.raises(RecipeError, match=r"line 4: data\.seq_length: Input should be a valid integer"):
        load_recipe(bad)


@pytest.mark.parametrize("text", ["", "# only a comment\n", "---\n"], ids=["empty", "comments", "bare-document"])
def test_a_file_without_settings_is_rejected(tmp_path, text):
    with pytest.raises(RecipeError, match="holds no settings"):
        load_recipe(write(tmp_path, text))


def test_files_that_are_not_yaml_text(tmp_path):
    utf16 = tmp_path / "utf16.yaml"
    utf16.write_text("optim:\n  lr: 1.0e-3\n", encoding="utf-16")
    with pytest.raises(RecipeError, match="UTF-16 text, not UTF-8"):
        load_recipe(utf16)
    ckpt = tmp_path / "model.pt"
    ckpt.write_bytes(b"PK\x03\x04\x14\x00\x00\x00")
    with pytest.raises(RecipeError, match=r"a binary file: a zip archive .*NUL byte at byte 5"):
        load_recipe(ckpt)
    big = tmp_path / "big.yaml"
    with open(big, "wb") as f:
        f.truncate(2 << 20)
    with pytest.raises(RecipeError, match="too big for a recipe"):
        load_recipe(big)


def test_paths_that_are_not_recipe_files(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "recipe.resolved.yaml").write_text("{}\n")
    with pytest.raises(RecipeError, match=r"is a run directory, not a recipe file; its recipe is .*recipe\.resolved"):
        load_recipe(run)
    fifo = tmp_path / "pipe.yaml"
    os.mkfifo(fifo)
    with pytest.raises(RecipeError, match="not a regular file"):  # and does not block reading it
        load_recipe(fifo)
    link = tmp_path / "link.yaml"
    link.symlink_to(tmp_path / "gone.yaml")
    with pytest.raises(RecipeError, match=r"not found \(a symlink to .*gone\.yaml"):
        load_recipe(link)


def test_unreadable_file(tmp_path):
    p = write(tmp_path, "optim:\n  lr: 1.0e-3\n")
    p.chmod(0)
    try:
        if os.access(p, os.R_OK):
            pytest.skip("running as a user who reads any file (root)")
        with pytest.raises(RecipeError, match="cannot be read: Permission denied"):
            load_recipe(p)
    finally:
        p.chmod(0o644)


def test_repeated_override_wins_and_the_summary_says_so():
    recipe = load_recipe(CONFIGS / "tiny_pretrain.yaml", ["optim.lr=0.001", "data.seq_length=32", "optim.lr=0.002"])
    assert recipe.optim.lr == 0.002 and recipe.data.seq_length == 32
    assert "  override optim.lr given twice (0.001, then 0.002): using 0.002" in recipe.summary().splitlines()
    assert load_recipe(CONFIGS / "tiny_pretrain.yaml", {"optim.lr": 1e-3, " optim.lr": 3e-3}).notes == (
        "override optim.lr given twice (0.001, then 0.003): using 0.003",
    )
    thrice = load_recipe(None, ["optim.lr=1", "optim.lr=2", "optim.lr=3"])
    assert thrice.notes == ("override optim.lr given 3 times (1, 2, then 3): using 3",)
    # Notes are not settings: the same settings loaded without a repeat are the same recipe.
    assert recipe == load_recipe(CONFIGS / "tiny_pretrain.yaml", ["optim.lr=0.002", "data.seq_length=32"])
    assert "given twice" not in load_recipe(CONFIGS / "tiny_pretrain.yaml", ["optim.lr=0.002"]).summary()
