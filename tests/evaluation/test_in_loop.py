"""``logging.eval_tasks``: lm-evaluation-harness on the live model inside the loop. Its ``eval/<task>/<metric>`` rows
come at every evaluation and once each across a resume, equal what ``canntrain eval`` gives on the same weights, and
leave the training itself unchanged (the harness seeds every random generator; the loop's are given back)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path

import pytest

from canntrain_core.errors import BadInput
from canntrain_core.recipe import load_recipe
from canntrain_core.stages import make_trainer
from conftest import CONFIGS, rows_by_step, sort_choice_task, task_data

pytestmark = [
    pytest.mark.slow,  # the alignment start, when no other test has trained it
    pytest.mark.skipif(importlib.util.find_spec("lm_eval") is None, reason="lm_eval is not installed (the eval extra)"),
]
ITEMS = 16
TASKS = ["canntrain_upper", "sort_choice"]  # generated and exact-matched; scored by log-likelihood (a number > 0)
METRICS = {"canntrain_upper": "exact_match", "sort_choice": "acc"}


def lora_recipe(start, tmp_path, **extra):
    """LoRA (its dropout draws from torch's generator) on the tiny start's fine-tuned model, evaluated every 4 steps."""
    return load_recipe(
        CONFIGS / "tiny_sft.yaml",
        {
            "model.init_from": str(start.sft_hf),
            "data.source": task_data(tmp_path, n=1000),
            "data.cache_dir": str(Path(os.environ["CANNTRAIN_RUNS"]) / "data-cache"),
            "data.batch_size": 8,
            "lora.enabled": True,
            "lora.dropout": 0.1,
            "optim.lr": 1e-2,
            "optim.max_steps": 8,
            "logging.log_interval": 1,
            "logging.eval_interval": 4,
            "logging.ckpt_interval": 2,
            "logging.keep_last": 5,
            "logging.eval_exact_match": 0,
            **extra,
        },
    )


def test_eval_rows_at_each_evaluation_once_across_a_resume_equal_canntrain_eval(start, tmp_path):
    from canntrain_core.jobs.harness import evaluate

    sort_choice_task(tmp_path / "tasks", ITEMS)
    folder = str(tmp_path / "tasks")
    tasks = {"logging.eval_tasks": TASKS, "logging.eval_tasks_limit": ITEMS, "logging.eval_include_path": folder}
    run = tmp_path / "run"
    make_trainer(lora_recipe(start, tmp_path, **tasks), run_dir=run, progress=False).fit(stop_after=5)
    for step in (4, 5):  # as if killed after step 5's row with the last checkpoint at 2: step 4's evaluation again
        shutil.rmtree(run / "checkpoints" / f"step_{step}")
    make_trainer(lora_recipe(start, tmp_path, **tasks), run_dir=run, resume_from="auto", progress=False).fit()
    plain = tmp_path / "plain"
    make_trainer(lora_recipe(start, tmp_path), run_dir=plain, progress=False).fit()

    rows, without = rows_by_step(run), rows_by_step(plain)
    keys = [f"eval/{t}/{m}" for t, m in METRICS.items()]
    assert [s for s in sorted(rows) if keys[0] in rows[s]] == [0, 4, 8]  # once each (metrics.jsonl holds no repeat)
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if keys[0] in r] == [0, 4, 8]
    for step, row in without.items():  # the same training: dropout's draws were not moved by the harness's seeds
        assert {k: v for k, v in rows[step].items() if not k.startswith("eval/")} == row, step
    at = {}
    for step, source in ((0, start.sft_hf), (8, run)):  # step 0: the base itself (LoRA's B starts at zero)
        results, _ = evaluate(
            source, TASKS, folder, limit=ITEMS, batch_size=8, chat=True, n_items=ITEMS, work=tmp_path / "w"
        )
        at[step] = {f"eval/{t}/{m}": results["results"][t][f"{m},none"] for t, m in METRICS.items()}
        assert {k: rows[step][k] for k in keys} == at[step], step
    assert at[0]["eval/sort_choice/acc"] > 0.5  # a model that knows the task (the base of a tuned SFT), scored so


def test_pretraining_scores_a_local_perplexity_task_as_canntrain_eval_does(tmp_path, fast_recipe):
    from canntrain_core.jobs.harness import evaluate

    docs = sorted((Path(json.__file__).parent).glob("*.py"))
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": p.read_text()[:2000]}) + "\n" for p in docs))
    (tmp_path / "stdlib_json.yaml").write_text(
        "task: stdlib_json\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {tmp_path / 'docs.jsonl'}\n"
        "test_split: test\noutput_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\n"
        "metric_list:\n  - metric: word_perplexity\n  - metric: bits_per_byte\n"
    )
    recipe = fast_recipe(
        **{"logging.eval_tasks": ["stdlib_json"], "logging.eval_include_path": str(tmp_path), "optim.max_steps": 6}
    )
    run = tmp_path / "run"
    make_trainer(recipe, run_dir=run, progress=False).fit()
    rows = rows_by_step(run)
    assert [s for s in sorted(rows) if "eval/stdlib_json/bits_per_byte" in rows[s]] == [0, 6]
    assert rows[6]["eval/stdlib_json/bits_per_byte"] < rows[0]["eval/stdlib_json/bits_per_byte"]
    length = recipe.data.seq_length  # the loop's rows: what training holds in memory
    results, _ = evaluate(run, ["stdlib_json"], str(tmp_path), batch_size=4, work=tmp_path / "w", max_length=length)
    theirs = results["results"]["stdlib_json"]
    for metric in ("word_perplexity", "bits_per_byte"):
        assert rows[6][f"eval/stdlib_json/{metric}"] == pytest.approx(theirs[f"{metric},none"], rel=1e-5)


def test_an_unknown_task_is_one_line_naming_the_key(tmp_path, fast_recipe):
    recipe = fast_recipe(**{"logging.eval_tasks": ["no_such_task"], "logging.eval_include_path": str(tmp_path)})
    with pytest.raises(BadInput, match=r"logging\.eval_tasks: no_such_task is no task of the harness or in "):
        make_trainer(recipe, run_dir=tmp_path / "run", progress=False)


def test_an_include_path_that_is_no_folder_is_one_line_naming_the_key(tmp_path, fast_recipe):
    recipe = fast_recipe(**{"logging.eval_tasks": ["tiny"], "logging.eval_include_path": str(tmp_path / "missing")})
    with pytest.raises(BadInput, match=r"logging\.eval_include_path: .*missing is no folder"):
        make_trainer(recipe, run_dir=tmp_path / "run", progress=False)


def test_without_the_harness_installed_the_key_is_one_line(tmp_path, fast_recipe, monkeypatch):
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # as if it were not installed
    monkeypatch.setitem(sys.modules, "canntrain_core.evaluation.in_loop", None)  # nor imported by an earlier test
    recipe = fast_recipe(**{"logging.eval_tasks": ["canntrain_sort"]})
    with pytest.raises(BadInput, match=r"logging\.eval_tasks runs EleutherAI's lm-evaluation-harness.*pip install"):
        make_trainer(recipe, run_dir=tmp_path / "run", progress=False)


def test_a_harness_run_skips_the_harness_environment_report(tmp_path):
    """run_tasks leaves out the harness's add_env_info (torch's environment report: pip list and compilers' versions
    in subprocesses, about a second at every in-loop evaluation, none of it kept) and puts it back afterwards."""
    import lm_eval.evaluator
    from lm_eval.api.model import LM
    from lm_eval.loggers.utils import add_env_info

    from canntrain_core.evaluation.harness_run import run_tasks, task_manager

    class Constant(LM):  # the harness needs some model; what is under test is what run_tasks asks of the harness
        def loglikelihood(self, requests):
            return [(-1.0, True) for _ in requests]

        def loglikelihood_rolling(self, requests):
            return [-1.0 for _ in requests]

        def generate_until(self, requests):
            return ["" for _ in requests]

    (tmp_path / "docs.jsonl").write_text(json.dumps({"text": "a b c"}) + "\n")
    (tmp_path / "tiny.yaml").write_text(
        "task: tiny\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {tmp_path / 'docs.jsonl'}\n"
        "test_split: test\noutput_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\n"
        "metric_list:\n  - metric: word_perplexity\n"
    )
    out = run_tasks(Constant(), ["tiny"], task_manager(["tiny"], str(tmp_path), tmp_path / "w", 1))
    assert "word_perplexity,none" in out["results"]["tiny"]
    assert "pretty_env_info" not in out and "transformers_version" not in out
    assert lm_eval.evaluator.add_env_info is add_env_info
