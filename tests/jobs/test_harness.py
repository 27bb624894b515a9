"""`canntrain eval`: lm-evaluation-harness on canntrain's models, offline. The fine-tuned tiny Llama of the alignment
notebooks' start (its run and its export), a canntrain task as a harness task (generate, exact match), and a local
multiple-choice task in the harness's YAML format (log-likelihoods): the harness's accuracy equals the same check
done by hand, canntrain's LM on the run equals the harness's own HFLM on the export, and a bad task name is one
line."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from canntrain_core.errors import BadInput
from canntrain_core.finetune.tasks import score
from canntrain_core.jobs.generate import load_generator
from conftest import sort_choice_task

ITEMS = 24
pytestmark = [
    pytest.mark.slow,  # the alignment start: minutes when no other test has trained it
    pytest.mark.skipif(importlib.util.find_spec("lm_eval") is None, reason="lm_eval is not installed (the eval extra)"),
]


@pytest.fixture(scope="module")
def harness():
    """The harness and canntrain's side of it, imported when a test runs: 6 s of imports that a deselected
    module (make test-fast) should not pay at collection."""
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    from canntrain_core.evaluation.harness_run import task_manager
    from canntrain_core.jobs.harness import language_model

    return simple_evaluate, HFLM, task_manager, language_model


def test_exact_match_through_the_harness_equals_the_check_by_hand(start, tmp_path, harness):
    """The harness's answers are canntrain's greedy answers to the same chat prompts, and its exact match is
    ``finetune.tasks.score`` over them (this start gets few of the sort items exactly right: the answers are what
    is compared, item by item)."""
    simple_evaluate, _, task_manager, language_model = harness
    manager = task_manager(["canntrain_sort"], None, tmp_path, ITEMS)
    lm = language_model(start.sft_run, batch_size=ITEMS, chat=True)  # one batch, as generate() decodes them
    out = simple_evaluate(model=lm, tasks=["canntrain_sort"], task_manager=manager, log_samples=True)
    samples = sorted(out["samples"]["canntrain_sort"], key=lambda s: s["doc_id"])
    items = [json.loads(x) for x in (tmp_path / "tasks" / "canntrain_sort.jsonl").read_text().splitlines()]
    answers = load_generator(start.sft_run).generate([i["prompt"] for i in items], chat=True, max_new_tokens=16)
    assert [s["filtered_resps"][0] for s in samples] == [a.text.split("\n")[0] for a in answers]
    by_hand = [score(a.text.split("\n")[0], i["answer"]) for a, i in zip(answers, items)]
    assert [s["exact_match"] for s in samples] == by_hand
    assert out["results"]["canntrain_sort"]["exact_match,none"] == pytest.approx(sum(by_hand) / ITEMS)


def test_canntrain_on_the_run_scores_as_the_harness_own_hflm_on_the_export(start, tmp_path, harness):
    simple_evaluate, HFLM, task_manager, language_model = harness
    task = sort_choice_task(tmp_path, ITEMS)
    manager = task_manager([task], str(tmp_path), tmp_path, ITEMS)
    runs = {
        "canntrain": language_model(start.sft_run, batch_size=4),
        "hf": HFLM(pretrained=str(start.sft_hf), device="cpu", batch_size=4, dtype="float32"),
    }
    out = {k: simple_evaluate(model=lm, tasks=[task], task_manager=manager, log_samples=True) for k, lm in runs.items()}
    ours, theirs = ([s["resps"] for s in out[k]["samples"][task]] for k in ("canntrain", "hf"))
    assert len(ours) == ITEMS
    for a, b in zip(ours, theirs):
        for (lp_a, greedy_a), (lp_b, greedy_b) in zip((r[0] for r in a), (r[0] for r in b)):
            assert lp_a == pytest.approx(lp_b, abs=1e-4) and greedy_a == greedy_b
    acc = {k: out[k]["results"][task]["acc,none"] for k in out}
    assert acc["canntrain"] == acc["hf"]


def test_canntrain_eval_writes_its_results_in_the_run_and_a_bad_task_is_one_line(start, tmp_path, harness):
    task_manager = harness[2]
    out = tmp_path / "r.json"
    cmd = [sys.executable, "-m", "canntrain_core.cli", "eval", str(start.sft_run), "--tasks", "canntrain_add"]
    done = subprocess.run([*cmd, "--chat", "--limit", "8", "--output", str(out)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "exact_match" in done.stdout and json.loads(out.read_text())["n-samples"]["canntrain_add"]["effective"] == 8
    with pytest.raises(BadInput, match="canntrain_sorted is no canntrain task"):
        task_manager(["canntrain_sorted"], None, tmp_path, 4)
    with pytest.raises(BadInput, match="no_such_task is no task of the harness"):
        task_manager(["no_such_task"], str(tmp_path), tmp_path, 4)
    with pytest.raises(BadInput, match=f"--include_path: {tmp_path / 'tasks.yaml'} is no folder"):
        task_manager(["no_such_task"], str(tmp_path / "tasks.yaml"), tmp_path, 4)
