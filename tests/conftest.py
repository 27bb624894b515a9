"""Shared fixtures: a tiny recipe that trains in seconds, with a per-session data cache."""

import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

import forked_kernels
from canntrain_core.recipe import load_recipe

# Tests live in folders that mirror canntrain_core's packages (tests/sizing/ for canntrain_core/sizing/, ...);
# the paths they share are named here once.
ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "cookbook" / "llama" / "configs"
BAD_INPUTS = ROOT / "tests" / "bad_inputs"  # one bad input a file (tests/recipe/test_bad_inputs.py)
TINY = CONFIGS / "tiny_pretrain.yaml"

# Small enough that a step takes milliseconds, big enough that the loss visibly falls.
FAST = {
    "data.max_bytes": 300_000,
    "data.tokenizer.vocab_size": 512,
    "data.seq_length": 64,
    "data.batch_size": 4,
    "optim.max_steps": 12,
    "optim.warmup_steps": 2,
    "logging.log_interval": 1,
    "logging.eval_interval": 6,
    "logging.eval_batches": 2,
    "logging.ckpt_interval": 6,
}


# Metrics that measure the wall clock or the machine, not the training: equal runs differ in them (resume tests drop
# every key containing one of these).
WALL_CLOCK = (
    "timing_s/",
    "perf/",
    "tokens_per_second",
    "tflops",
    "mfu",
    "step_time",
    "peak_memory",
    "checkpoint_seconds",
)


def rows_by_step(run_dir) -> dict[int, dict]:
    """A run's metrics.jsonl by step, without the wall-clock figures: what two equal runs agree on exactly."""
    from canntrain_core.train.metrics import read_metrics

    return {
        r["step"]: {k: v for k, v in r.items() if not any(t in k for t in WALL_CLOCK)} for r in read_metrics(run_dir)
    }


# `make test-fast` (-m "not slow"): what trains a session's shared runs, launches several processes or
# executes notebooks is slow; everything else runs in the edit loop.
SLOW_FIXTURES = {"pretrained", "sft_run", "runs", "start", "reward_run"}
SLOW_FILES = {
    "test_rlhf.py",
    "test_distributed.py",
    "test_launch.py",
    "test_notebooks.py",
    "test_sweep.py",
    "test_setup_memory.py",
    "test_memory_notebook.py",
}


def pytest_configure(config):
    """Every run without a directory of its own (notebooks under nbmake, the alignment tests' shared runs)
    goes to one temporary $CANNTRAIN_RUNS for the session, never into the checkout; every tokenizer and tokenized
    corpus without a data.cache_dir to one $CANNTRAIN_CACHE inside it, never into the user's ~/.cache/canntrain (so a
    second run here prepares what CI's first does)."""
    if not os.environ.get("CANNTRAIN_RUNS"):
        config._canntrain_runs = os.environ["CANNTRAIN_RUNS"] = tempfile.mkdtemp(prefix="canntrain-runs-")
    if not os.environ.get("CANNTRAIN_CACHE"):
        config._canntrain_cache = os.environ["CANNTRAIN_CACHE"] = str(Path(os.environ["CANNTRAIN_RUNS"]) / "data-cache")
    if config.getoption("nbmake", False) and not hasattr(config, "workerinput"):
        _start_forked_kernels(config)
    if folder := forked_kernels.session_folder():  # this process's forkserver (local ranks) is forked by it too
        forked_kernels.use_interpreter(folder)


def _start_forked_kernels(config):
    """A session that runs notebooks (``--nbmake``) starts their kernels forked from one that has imported torch,
    transformers and canntrain already (tests/forked_kernels.py), in the controller, before the workers start:
    about 5 CPU-s less for each of the session's kernels. $JUPYTER_PATH points Jupyter's python3 kernel at it."""
    folder = config._forked_kernels = tempfile.mkdtemp(prefix=forked_kernels.FOLDER_PREFIX)
    socket_path = forked_kernels.socket_in(folder)
    forked_kernels.kernelspec(folder, socket_path)
    config._jupyter_path = os.environ.get("JUPYTER_PATH")
    os.environ["JUPYTER_PATH"] = os.pathsep.join(filter(None, [folder, config._jupyter_path]))
    config._zygote = subprocess.Popen([sys.executable, forked_kernels.__file__, "serve", socket_path])


def _stop_forked_kernels(config):
    multiprocessing.set_executable(sys.executable)
    config._zygote.terminate()
    config._zygote.wait(timeout=30)
    shutil.rmtree(config._forked_kernels, ignore_errors=True)
    if config._jupyter_path is None:
        del os.environ["JUPYTER_PATH"]
    else:
        os.environ["JUPYTER_PATH"] = config._jupyter_path


def pytest_unconfigure(config):
    if getattr(config, "_zygote", None):
        _stop_forked_kernels(config)
    if getattr(config, "_canntrain_cache", None):
        del os.environ["CANNTRAIN_CACHE"]
    runs = getattr(config, "_canntrain_runs", None)
    if runs:
        shutil.rmtree(runs, ignore_errors=True)
        del os.environ["CANNTRAIN_RUNS"]


# Executed headless by tests/jobs/test_notebooks.py (papermill, its outputs checked for warnings as nbmake's are):
# nbmake does not run it a second time.
RUN_ELSEWHERE = {"00_quickstart.ipynb"}


def pytest_collection_modifyitems(config, items):
    elsewhere = [item for item in items if item.path.suffix == ".ipynb" and item.path.name in RUN_ELSEWHERE]
    if elsewhere:
        config.hook.pytest_deselected(items=elsewhere)
        items[:] = [item for item in items if item not in elsewhere]
    for item in items:
        if (
            SLOW_FIXTURES & set(getattr(item, "fixturenames", ()))
            or item.path.name in SLOW_FILES
            or item.path.suffix == ".ipynb"
        ):
            item.add_marker(pytest.mark.slow)
    # xdist (--dist loadfile) hands out the files with the most items first (its default --loadscope-reorder), and
    # among files of as many items, in this order: the slow ones first, the longest of those first. So the notebooks
    # (one item each) come last, once the runs they share with the tests (the pretrained base, the alignment start)
    # are built, and no worker starts a long one while the others are about to end.
    items.sort(key=lambda item: (item.get_closest_marker("slow") is None, _longest_first(item)))


# The files of one slow item, longest first: each took 30-80 s of a worker in a clean clone's suite here (the rest
# under 35 s)
LONGEST_FIRST = (
    "cookbook/llama/rlhf_ppo.ipynb",
    "cookbook/llama/lora.ipynb",
    "cookbook/llama/pretrain.ipynb",
    "cookbook/moe/pretrain.ipynb",
    "tests/memory/test_setup_memory.py",
    "cookbook/gpt/pretrain.ipynb",
    "cookbook/llama/fused_kernels.ipynb",
    "cookbook/troubleshooting.ipynb",
)


def _longest_first(item) -> int:
    """``item``'s place in LONGEST_FIRST (after all of it when not there)."""
    path = item.path.as_posix()
    return next((i for i, file in enumerate(LONGEST_FIRST) if path.endswith(f"/{file}")), len(LONGEST_FIRST))


@pytest.fixture(scope="session")
def data_cache() -> str:
    """The tokenizers and tokenized corpora of the session, shared by the workers (their builds take a lock) and
    the notebooks ($CANNTRAIN_CACHE, unless the caller set one)."""
    return os.environ["CANNTRAIN_CACHE"]


@pytest.fixture
def fast_recipe(data_cache):
    """Build the tiny recipe with FAST settings plus any extra overrides."""

    def make(**extra):
        return load_recipe(TINY, {**FAST, "data.cache_dir": data_cache, **extra})

    return make


# ---- fine-tuning and alignment: one pretrained model and one SFT run serve every test of both
SFT = {
    "train_mode": "sft",
    "data.seq_length": 32,
    "data.batch_size": 32,
    "data.val_fraction": 0.03,
    "data.packing": True,
    "data.template.user": "{content} =",
    "data.template.assistant": " {content}{eos}",
    "optim.weight_decay": 0.0,
    "optim.warmup_steps": 10,
    "logging.log_interval": 1,
    "logging.eval_batches": 1,
    "logging.ckpt_interval": 10000,
}


def task_data(tmp_path, n=4000, kinds=("sort", "upper"), seed=0) -> str:
    from canntrain_core.jobs.alignment_start import task_file

    return str(task_file(tmp_path, n, seed, tuple(kinds)))


def sort_choice_task(folder: Path, n: int, seed: int = 7) -> str:
    """``sort_choice``, a multiple-choice task in lm-evaluation-harness's YAML format over a local JSONL file in
    ``folder``: ``n`` sort prompts, each with its answer and the digits as given, reversed."""
    from canntrain_core.finetune.tasks import task_records

    folder.mkdir(parents=True, exist_ok=True)
    rows = []
    for r in task_records(n, seed=seed, kinds=("sort",)):
        given = r["instruction"].split(": ", 1)[1]  # the digits unsorted: the likely mistake
        rows.append({"prompt": r["instruction"], "choices": [r["output"], given[::-1]], "label": 0})
    (folder / "choice.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "choice.yaml").write_text(
        "task: sort_choice\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {folder / 'choice.jsonl'}\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: '{{prompt}}'\n"
        "doc_to_choice: '{{choices}}'\ndoc_to_target: label\nmetric_list:\n  - metric: acc\n"
    )
    return "sort_choice"


@pytest.fixture(scope="session")
def pretrained(data_cache):
    """A tiny Llama pretrained for 60 steps on the stdlib, exported as a Hugging Face directory: the fine-tuning
    notebooks' and the alignment start's base (``jobs.alignment_start.pretrained_base``), built once."""
    from canntrain_core.jobs.alignment_start import pretrained_base

    return pretrained_base(CONFIGS, cache_dir=data_cache)


@dataclass
class SFTRun:
    run_dir: Path
    hf: Path  # its export
    tasks: str
    trainer: object


@pytest.fixture(scope="session")
def start():
    """What the alignment notebooks start from (``jobs.alignment_start.tiny_start`` in their workdir,
    $CANNTRAIN_RUNS/rlhf, cached there under this code's version): ``pretrained`` fine-tuned for 100 steps of
    tiny_sft.yaml on sort/uppercase (answers in the task's format, few of them exactly right), sort prompts and
    preference pairs. Built once for the session, whichever worker, notebook or test first asks."""
    from canntrain_core.jobs.alignment_start import tiny_start
    from canntrain_core.train.trainer import runs_root

    return tiny_start(runs_root() / "rlhf", CONFIGS)


@pytest.fixture(scope="session")
def sft_run(pretrained, tmp_path_factory) -> SFTRun:
    """sft.ipynb's fine-tune: 200 steps of tiny_sft.yaml on sort/uppercase from ``pretrained``, exact match scored
    before and after, trained once for the session by whichever of the notebook or a test first asks
    (``jobs.alignment_start.trained`` in the notebook's workdir, $CANNTRAIN_RUNS/sft); the trainer is the finished
    run's, and the export this worker's."""
    from canntrain_core.checkpoint.export import export_hf
    from canntrain_core.jobs.alignment_start import task_file, trained
    from canntrain_core.train.trainer import runs_root

    workdir = runs_root() / "sft"
    tasks = task_file(workdir, 4000, seed=0, kinds=("sort", "upper"))
    overrides = {"data.source": str(tasks), "optim.max_steps": 200, "logging.eval_interval": 200}
    trainer = trained(
        load_recipe(CONFIGS / "tiny_sft.yaml", {"model.init_from": str(pretrained), **overrides}), workdir, "sft"
    )
    hf = export_hf(trainer.run_dir, tmp_path_factory.mktemp("sft") / "hf").out
    return SFTRun(trainer.run_dir, hf, str(tasks), trainer)


def write_hf_model(
    path: Path, vocab: int = 300, tokenizer_vocab: int = 300, tie: bool = False, family: str = "llama", **shape
):
    """A random tiny model of ``family`` (canntrain_core/families/) and a byte-level BPE tokenizer, written by
    transformers' own classes and save_pretrained (``tie``: the output head is the embedding, as in Llama 3.2
    1B/3B; no lm_head.weight is written; ``shape``: config fields over the family's tiny preset's shape, 4
    layers of 128); transformers' defaults for everything else."""
    import torch
    from tokenizers import pre_tokenizers, trainers
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

    from canntrain_core.data.tokenizer import new_byte_level_bpe
    from canntrain_core.families import FAMILIES

    f = FAMILIES[family]
    fields = {  # the family's common fields too (GPT-2's: no dropout, so train-mode logits compare)
        k: v
        for k, v in {**f.common, **f.presets[f.tiny]}.items()
        if k not in ("vocab_size", "tie_word_embeddings", "bos_token_id", "eos_token_id")
    }
    fields["max_position_embeddings"] = 256
    config = AutoConfig.for_model(
        f.model_types[0],
        **{**fields, **shape},
        vocab_size=vocab,
        bos_token_id=None,
        eos_token_id=0,
        tie_word_embeddings=tie,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(path, max_shard_size="200KB")  # several shards and an index
    tok = new_byte_level_bpe()
    texts = [Path(p).read_text() for p in sorted((Path(os.__file__).parent / "json").glob("*.py"))]
    bpe = trainers.BpeTrainer(
        vocab_size=tokenizer_vocab,
        special_tokens=["</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, bpe)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>").save_pretrained(path)
    # then as the family's own tokenizer class writes it (Qwen2Tokenizer rebuilds its pre-tokenizer), so that
    # AutoTokenizer and tokenizer.json agree as on the hub; "</s>" for every special token it would add
    AutoTokenizer.from_pretrained(path, unk_token="</s>", pad_token="</s>").save_pretrained(path)
    return model
