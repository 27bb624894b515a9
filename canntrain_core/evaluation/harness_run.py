"""One run of the harness over a task list, the same for ``canntrain eval`` and the trainer's ``logging.eval_tasks``:
the tasks found (the harness's own, a folder of local YAML tasks, canntrain's written from ``finetune/tasks.py``),
the harness run quietly and without touching the caller's random state, its results as ``eval/<task>/<metric>``."""

from __future__ import annotations

import contextlib
import logging
import random
from pathlib import Path

import datasets
import lm_eval.api.model
import lm_eval.api.task
import lm_eval.evaluator
import numpy as np
import torch
from lm_eval import simple_evaluate
from lm_eval.loggers.utils import add_env_info
from lm_eval.tasks import TaskManager
from tqdm import tqdm

from canntrain_core.errors import BadInput
from canntrain_core.evaluation.harness_tasks import PREFIX, task_kind, write_tasks

# What the harness returns that a results file keeps (its samples and task objects are left out).
KEPT = ("results", "configs", "versions", "n-shot", "higher_is_better", "n-samples")


def task_manager(
    tasks: list[str],
    include_path: str | None,
    work: Path,
    n_items: int,
    key: str = "--tasks",
    include_key: str = "--include_path",
):
    """The harness's tasks with ``include_path``'s and, for ``canntrain_<kind>`` names, canntrain's own written
    into ``work/tasks`` (``n_items`` each); a name the harness does not know is one line naming ``key``, an include
    path that is no folder one naming ``include_key``."""
    bad = [t for t in tasks if t.startswith(PREFIX) and task_kind(t) is None]
    if bad:
        raise BadInput(f"{key}: {bad[0]} is no canntrain task (canntrain_reverse, _sort, _add, _upper)")
    if include_path and not Path(include_path).is_dir():  # the harness would pass over it and miss its tasks
        raise BadInput(f"{include_key}: {include_path} is no folder (of the harness's YAML tasks)")
    paths = [str(Path(include_path).resolve())] if include_path else []
    ours = sorted({k for k in map(task_kind, tasks) if k})
    if ours:
        paths.append(str(write_tasks(Path(work) / "tasks", ours, n_items)))
    manager = TaskManager(include_path=paths or None, include_defaults=False) if paths else None
    if manager is None or any(t not in manager.all_tasks for t in tasks):  # the harness's own tasks (seconds)
        manager = TaskManager(include_path=paths or None)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        where = f" or in {include_path}" if include_path else " (an include path adds a folder of YAML tasks)"
        raise BadInput(f"{key}: {unknown[0]} is no task of the harness{where}")
    return manager


BARS = (lm_eval.api.task, lm_eval.api.model)  # the harness's modules that draw a bar with the tqdm they imported


def _no_bar(iterable=None, *args, **kwargs):
    return iterable


def _no_env_info(results: dict) -> None:
    """In place of the harness's ``add_env_info``: torch's environment report it adds runs ``pip list``, compilers'
    ``--version`` and more in subprocesses (about 1 s and 0.75 CPU-s here, at every evaluation in the loop), and none
    of it is in what canntrain keeps (``KEPT``)."""


@contextlib.contextmanager
def quiet_and_seeded():
    """The harness's progress bars, per-task log lines and environment report off (the caller says what ran), and
    every random state it seeds (Python's, NumPy's, torch's) given back afterwards: a training run evaluated in the
    loop draws the same dropout masks and batches as one that is not."""
    harness_log = logging.getLogger("lm_eval")
    level, bars = harness_log.level, not datasets.are_progress_bars_disabled()
    harness_log.setLevel(logging.ERROR)
    lm_eval.evaluator.add_env_info = _no_env_info
    datasets.disable_progress_bars()  # loading a local task's JSONL is instant
    # the harness's bars over building and tokenizing requests (instant here): tqdm reads TQDM_DISABLE at its import
    for module in BARS:
        module.tqdm = _no_bar
    py, np_state = random.getstate(), np.random.get_state()
    try:
        with torch.random.fork_rng(devices=[]):
            yield
    finally:
        random.setstate(py)
        np.random.set_state(np_state)
        for module in BARS:
            module.tqdm = tqdm
        lm_eval.evaluator.add_env_info = add_env_info
        harness_log.setLevel(level)
        if bars:
            datasets.enable_progress_bars()


def run_tasks(lm, tasks: list[str], manager, limit: int | None = None, num_fewshot: int | None = None) -> dict:
    """The harness's whole output for ``tasks`` on ``lm`` (an ``lm_eval`` ``LM``); {} on a rank whose LOCAL_RANK is
    not 0, where the harness scores every request (the same forward passes as rank 0's) but keeps no results."""
    with quiet_and_seeded():
        out = simple_evaluate(
            model=lm, tasks=tasks, num_fewshot=num_fewshot, limit=limit, task_manager=manager, bootstrap_iters=1000
        )
    return out or {}


def flat_scores(results: dict) -> dict[str, float]:
    """``eval/<task>/<metric>`` for each task's numeric metrics (the harness's ``<metric>,<filter>`` with the
    filter ``none`` dropped, standard errors left out); none from a rank the harness kept no results on."""
    out = {}
    for task, metrics in results.get("results", {}).items():
        for name, value in metrics.items():
            if "," not in name or "_stderr" in name or not isinstance(value, (int, float)):
                continue
            metric, filt = name.split(",", 1)
            out[f"eval/{task}/{metric}" + ("" if filt == "none" else f"_{filt}")] = float(value)
    return out
