"""The starting point of the tiny alignment notebooks: a briefly pretrained, briefly fine-tuned Llama.

:func:`tiny_start` takes the tiny Llama pretrained on the standard library (:func:`pretrained_base`, which the
fine-tuning notebooks and the tests start from too), fine-tunes it (full SFT) on the
verifiable sort/uppercase task, exports the result as a Hugging Face directory and writes the data the
alignment stages read: prompts (sort only: the part of the task the fine-tuned model half knows, so a
policy has something to improve) and preference pairs ranked by the programmatic scorer. It is cached in
``workdir/start-<settings>``, so the second notebook (or a re-run) reuses it in a second (built under a file
lock: a process that wants it while another builds it waits, then reuses it); ``canntrain start``
copies it to where the tiny recipes look.

The SFT is deliberately short (100 steps): the model has learned the answer format and half the task,
which leaves a clear margin for reinforcement learning to show; ``sft.ipynb`` trains it to the end.

The caches (the base, the start, and :func:`trained` runs) are keyed by :func:`code_version` too: what a cache holds
was made by the code now installed, or it is not used. ``tests/stages/test_rlhf.py`` trains in the notebooks'
workdir (``$CANNTRAIN_RUNS/rlhf`` under the test suite) with their recipes, so CI runs each training once.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import canntrain_core
import canntrain_kernels
from canntrain_core.checkpoint.export import export_hf
from canntrain_core.data.cache import file_lock
from canntrain_core.errors import BadInput
from canntrain_core.finetune.alignment_data import preference_records
from canntrain_core.finetune.data import write_jsonl
from canntrain_core.finetune.tasks import task_records
from canntrain_core.recipe import load_recipe
from canntrain_core.stages import make_trainer
from canntrain_core.train.trainer import Trainer, runs_root


def code_version(*recipes: Path) -> str:
    """A hash of canntrain's source (and of ``recipes``' text): a cached start or run is only reused by the code
    that made it."""
    h = hashlib.sha256()
    packages = [Path(canntrain_core.__file__).parent, Path(canntrain_kernels.__file__).parent]
    for p in [*sorted(p for root in packages for p in root.rglob("*.py")), *recipes]:
        h.update(p.read_bytes())
    return h.hexdigest()[:8]


@dataclass
class Start:
    sft_hf: Path  # the fine-tuned model, a Hugging Face directory (model.init_from of every stage)
    prompts: Path  # instruction records of the sort task: the online stages' prompts
    pairs: Path  # preference pairs for the reward model and DPO
    sft_run: Path
    pretrained_hf: Path  # the pretrained base the SFT started from (pretrained_base)


def tiny_start(
    workdir: str | Path,
    configs: str | Path,
    pretrain_steps: int = 60,
    sft_steps: int = 100,
    seed: int = 0,
    cache_dir: str | None = None,
) -> Start:
    """The fine-tuned model and the data (see the module docstring), trained with ``configs``' (the cookbook's
    recipe folder) tiny_pretrain.yaml and tiny_sft.yaml; ``cache_dir``: the tokenized corpus's."""
    recipes = Path(configs) / "tiny_pretrain.yaml", Path(configs) / "tiny_sft.yaml"
    for path in recipes:
        if not path.is_file():
            raise BadInput(f"{path}: no such recipe; the tiny start trains the cookbook's tiny_pretrain and tiny_sft")
    settings = {"pretrain_steps": pretrain_steps, "sft_steps": sft_steps, "seed": seed}
    root = Path(workdir).resolve() / f"start-{pretrain_steps}-{sft_steps}-{seed}-{code_version(*recipes)}"
    with file_lock(root.with_name(root.name + ".lock")):  # another process building it: wait, then reuse
        return _build_start(root, recipes, settings, pretrain_steps, sft_steps, seed, cache_dir)


def _build_start(root: Path, recipes, settings: dict, pretrain_steps: int, sft_steps: int, seed: int, cache_dir):
    base = pretrained_base(recipes[0].parent, pretrain_steps, seed, cache_dir)  # built once, shared
    done = Start(root / "sft_hf", root / "prompts.jsonl", root / "pairs.jsonl", root / "sft", base)
    if (root / "settings.json").is_file():  # written last: a complete start
        return done
    shutil.rmtree(root, ignore_errors=True)
    tasks = write_jsonl(root / "tasks.jsonl", task_records(4000, seed=seed, kinds=("sort", "upper")))
    sft = load_recipe(
        recipes[1],
        {
            "model.init_from": str(base),
            "data.source": str(tasks),
            "optim.max_steps": sft_steps,
            "logging.eval_interval": sft_steps,
            "logging.ckpt_interval": sft_steps,
            "experiment.seed": seed,
        },
    )
    make_trainer(sft, run_dir=done.sft_run, progress=False).fit()
    export_hf(done.sft_run, done.sft_hf)
    write_jsonl(done.prompts, task_records(2000, seed=seed + 7, kinds=("sort",)))
    write_jsonl(done.pairs, preference_records(3000, seed=seed, kinds=("sort",)))
    (root / "settings.json").write_text(json.dumps(settings))
    return done


def pretrained_base(
    configs: str | Path, steps: int = 60, seed: int = 0, cache_dir: str | None = None, workdir: str | Path | None = None
) -> Path:
    """The tiny Llama pretrained for ``steps`` on 300 KB of the standard library (``configs``' tiny_pretrain.yaml)
    and exported as a Hugging Face directory: what the fine-tuning notebooks, the alignment start and the tests
    start from. Built once in ``workdir`` (default ``runs/start``, ``$CANNTRAIN_RUNS/start`` when set) under a
    lock and reused while the code is the same (:func:`code_version`)."""
    recipe_path = Path(configs) / "tiny_pretrain.yaml"
    root = Path(workdir or runs_root() / "start").resolve() / f"pretrained-{steps}-{seed}-{code_version(recipe_path)}"
    with file_lock(root.with_name(root.name + ".lock")):
        if (root / "done").is_file():
            return root / "hf"
        shutil.rmtree(root, ignore_errors=True)
        pre = load_recipe(
            recipe_path,
            {
                "data.max_bytes": 300_000,
                "data.seq_length": 64,
                "data.batch_size": 4,
                "optim.max_steps": steps,
                "optim.warmup_steps": 2,
                "logging.log_interval": 10,
                "logging.eval_interval": steps,
                "logging.eval_batches": 2,
                "logging.ckpt_interval": steps,
                "experiment.seed": seed,
                **({"data.cache_dir": cache_dir} if cache_dir else {}),
            },
        )
        Trainer(pre, run_dir=root / "run", progress=False).fit()
        export_hf(root / "run", root / "hf")
        (root / "done").write_text("")
    return root / "hf"


def task_file(workdir: str | Path, n: int = 4000, seed: int = 0, kinds: tuple[str, ...] = ("sort", "upper")) -> Path:
    """``n`` generated task records of ``kinds`` (``finetune.tasks``) in ``workdir``, written once under a lock: the
    same path and content each time, so that a recipe naming it is the same recipe and :func:`trained` reuses its run
    (sft.ipynb and the tests' SFT run)."""
    path = Path(workdir).resolve() / f"tasks-{'-'.join(kinds)}-{n}-{seed}.jsonl"
    with file_lock(path.with_name(path.name + ".lock")):
        if not path.is_file():
            write_jsonl(path, task_records(n, seed=seed, kinds=kinds))
    return path


def trained(recipe, workdir: str | Path, name: str):
    """A trainer of ``recipe`` that has run to its end in ``workdir/name-<recipe hash>``: trained now, or,
    when an earlier notebook already trained the very same recipe there, loaded from its last checkpoint
    (the metrics are that run's; the model, optimizer and data position are its final ones)."""
    recipe_hash = hashlib.sha256(recipe.to_yaml().encode()).hexdigest()[:10]
    run = Path(workdir).resolve() / f"{name}-{recipe_hash}-{code_version()}"
    with file_lock(run.with_name(run.name + ".lock")):
        if (run / "done").is_file():
            return make_trainer(recipe, run_dir=run, resume_from="auto", progress=False)
        shutil.rmtree(run, ignore_errors=True)
        trainer = make_trainer(recipe, run_dir=run, progress=False)
        trainer.fit()
        (run / "done").write_text("")
    return trainer
