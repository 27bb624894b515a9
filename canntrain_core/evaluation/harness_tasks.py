"""canntrain's verifiable tasks (``finetune/tasks.py``) as lm-evaluation-harness tasks, offline: a YAML task per
kind in the harness's own format, its items a local JSONL file (``dataset_path: json``), so the harness loads them
with ``datasets`` as it loads any task, and ``canntrain eval --tasks canntrain_sort`` needs no download.

Each is a ``generate_until`` task scored by the harness's ``exact_match`` with surrounding whitespace ignored, which
is ``finetune.tasks.score``: the prompt is the instruction, the target the answer, generation greedy and cut at a
newline.
"""

from __future__ import annotations

import json
from pathlib import Path

from canntrain_core.finetune.tasks import KINDS, task_records

PREFIX = "canntrain_"
EVAL_SEED = 1234  # other items than the tiny recipes' training data (seed 0)


def task_kind(name: str) -> str | None:
    """The kind of a ``canntrain_<kind>`` task name, or None for any other task."""
    kind = name[len(PREFIX) :] if name.startswith(PREFIX) else None
    return kind if kind in KINDS else None


def write_tasks(out: str | Path, kinds: list[str], n: int = 100, seed: int = EVAL_SEED, max_new: int = 16) -> Path:
    """A harness task directory (``--include_path``) with ``canntrain_<kind>`` for each of ``kinds``: ``n`` items
    each, drawn with ``seed``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for kind in kinds:
        items = out / f"{PREFIX}{kind}.jsonl"
        records = task_records(n, seed, (kind,))
        items.write_text(
            "".join(json.dumps({"prompt": r["instruction"], "answer": r["output"]}) + "\n" for r in records)
        )
        task = {
            "task": f"{PREFIX}{kind}",
            "dataset_path": "json",
            "dataset_kwargs": {"data_files": {"test": str(items.resolve())}},
            "test_split": "test",
            "output_type": "generate_until",
            "doc_to_text": "{{prompt}}",
            "doc_to_target": "{{answer}}",
            "generation_kwargs": {"until": ["\n"], "max_gen_toks": max_new, "do_sample": False},
            "metric_list": [
                {
                    "metric": "exact_match",
                    "aggregation": "mean",
                    "higher_is_better": True,
                    "regexes_to_ignore": ["^\\s+", "\\s+$"],
                }
            ],
            "metadata": {"version": 1.0},
        }
        (out / f"{PREFIX}{kind}.yaml").write_text(json.dumps(task, indent=1))  # JSON is YAML
    return out
