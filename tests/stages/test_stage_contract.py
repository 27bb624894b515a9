"""Every train_mode runs through the same loop contract: it builds from a Hugging Face directory (or a
preset), takes steps, checkpoints, resumes bit-exactly, and runs under fp32, bf16 and fp16 (fp16: the
loop's loss scaler is used; a stage that called backward() without it crashed in unscale_).

One tiny model (2 layers, hidden 64) and 4 steps per stage: the point is the contract, not the learning
(tests/stages/test_rlhf.py and test_sft.py check that).
"""

from __future__ import annotations

import math
import textwrap
import typing

import pytest
import torch

from canntrain_core.finetune.data import write_jsonl
from canntrain_core.finetune.tasks import task_records
from canntrain_core.recipe import Recipe, load_recipe
from canntrain_core.finetune.alignment_data import preference_records
from canntrain_core.train.metrics import read_metrics
from conftest import rows_by_step, CONFIGS, write_hf_model
from canntrain_core.stages import make_trainer
from canntrain_core.train.stage import DataBundle


STEPS = 4
SMALL = {
    "optim.max_steps": STEPS,
    "optim.warmup_steps": 1,
    "logging.log_interval": 1,
    "logging.eval_interval": STEPS,
    "logging.ckpt_interval": 2,
    "logging.eval_exact_match": 4,
    "data.val_fraction": 0.1,
}
STAGE = {  # the shipped tiny recipe of each stage, shrunk
    "pretrain": {
        "data.max_bytes": 60_000,
        "data.seq_length": 32,
        "data.batch_size": 4,
        "data.tokenizer.vocab_size": 300,
        "logging.eval_exact_match": 0,
        "logging.eval_batches": 1,
    },
    "sft": {"data.batch_size": 8, "data.seq_length": 64},
    "reward": {"data.batch_size": 8, "data.seq_length": 64},
    "dpo": {"data.batch_size": 8, "data.seq_length": 64},
    "grpo": {
        "data.batch_size": 4,
        "data.seq_length": 64,
        "rlhf.group_size": 2,
        "rlhf.generate_max_length": 6,
        "rlhf.ppo_epochs": 1,
        "rlhf.mini_batch_size": 8,
    },
    "ppo": {
        "data.batch_size": 8,
        "data.seq_length": 64,
        "rlhf.generate_max_length": 6,
        "rlhf.ppo_epochs": 1,
        "rlhf.mini_batch_size": 8,
    },
}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, str]:
    """A tiny Llama written by transformers' save_pretrained, with a tokenizer, and the stages' data."""
    d = tmp_path_factory.mktemp("contract")
    hf = d / "hf"
    write_hf_model(
        hf,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=128,
    )
    return {
        "hf": str(hf),
        "tasks": str(write_jsonl(d / "tasks.jsonl", task_records(300, seed=0, kinds=("sort", "upper")))),
        "prompts": str(write_jsonl(d / "prompts.jsonl", task_records(200, seed=7, kinds=("sort",)))),
        "pairs": str(write_jsonl(d / "pairs.jsonl", preference_records(300, seed=0, kinds=("sort",)))),
    }


def _recipe(mode: str, inputs: dict, data_cache: str, **extra):
    source = {
        "pretrain": "stdlib",
        "sft": inputs["tasks"],
        "reward": inputs["pairs"],
        "dpo": inputs["pairs"],
        "grpo": inputs["prompts"],
        "ppo": inputs["prompts"],
    }[mode]
    start = {} if mode == "pretrain" else {"model.init_from": inputs["hf"]}
    return load_recipe(
        CONFIGS / f"tiny_{mode}.yaml",
        {**SMALL, **STAGE[mode], **start, "data.source": source, "data.cache_dir": data_cache, **extra},
    )


def test_every_train_mode_is_checked_here_and_has_a_tiny_recipe():
    modes = typing.get_args(Recipe.model_fields["train_mode"].annotation)
    assert sorted(STAGE) == sorted(modes)
    assert all((CONFIGS / f"tiny_{m}.yaml").is_file() for m in modes)


@pytest.mark.parametrize("mode", list(STAGE))
def test_a_stage_resumes_bit_exactly(mode, inputs, data_cache, tmp_path):
    recipe = _recipe(mode, inputs, data_cache)
    full = make_trainer(recipe, run_dir=tmp_path / "full", progress=False)
    assert isinstance(full.data, DataBundle), type(full.data)  # one data interface for every stage
    full.fit()
    make_trainer(recipe, run_dir=tmp_path / "cut", progress=False).fit(stop_after=2)
    make_trainer(recipe, run_dir=tmp_path / "cut", resume_from="auto", progress=False).fit()
    full, cut = rows_by_step(tmp_path / "full"), rows_by_step(tmp_path / "cut")
    assert sorted(full) == sorted(cut) and STEPS in full
    assert full == cut


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("mode", list(STAGE))
def test_a_stage_trains_in_16_bit(mode, precision, inputs, data_cache, tmp_path):
    trainer = make_trainer(
        _recipe(mode, inputs, data_cache, **{"model.precision": precision}), run_dir=tmp_path / "run", progress=False
    )
    trainer.fit()
    rows = read_metrics(tmp_path / "run")
    losses = [v for r in rows for k, v in r.items() if k in ("loss", "actor/pg_loss") and isinstance(v, float)]
    assert losses and all(math.isfinite(v) for v in losses), rows
    assert trainer.scaler.is_enabled() == (precision == "fp16")
    # a model that never trains (a reference, a reward model) is held in the 16-bit dtype; what trains stays fp32
    half = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    for name, model in trainer.models().items():
        dtypes = {p.dtype for p in model.parameters()}
        assert dtypes == ({torch.float32} if any(p.requires_grad for p in model.parameters()) else {half}), name
    if precision == "fp16":
        assert trainer.scaler.get_scale() > 0  # the scaler ran: unscale_ found a scale


def test_a_stage_recipe_never_runs_another_stages_loop(inputs, data_cache, tmp_path):
    """The engine's Trainer handed a reward recipe used to run the pretraining loop on it, silently."""
    from canntrain_core.errors import RecipeError
    from canntrain_core.train.trainer import Trainer

    for mode in ("sft", "reward", "grpo"):
        with pytest.raises(RecipeError, match=f"train_mode {mode}: Trainer trains pretrain; build a recipe's trainer"):
            Trainer(_recipe(mode, inputs, data_cache), run_dir=tmp_path / mode, progress=False)
        assert not (tmp_path / mode).exists()


@pytest.mark.parametrize("mode", list(STAGE))
def test_a_stage_exports_its_language_model_or_says_why_not(mode, inputs, data_cache, tmp_path):
    """export (and generate) read what the stage wrote into its checkpoint (stage.json): PPO's actor, not its
    critic; a reward model refused with its reason; every other stage's model, loaded by transformers to the
    trained model's logits."""
    from transformers import AutoModelForCausalLM

    from canntrain_core.checkpoint.export import export_hf
    from canntrain_core.errors import BadInput

    trainer = make_trainer(_recipe(mode, inputs, data_cache), run_dir=tmp_path / "run", progress=False)
    trainer.fit()
    if mode == "reward":
        with pytest.raises(BadInput, match="a reward model scores answers with a one-row head"):
            export_hf(tmp_path / "run", tmp_path / "hf")
        return
    export_hf(tmp_path / "run", tmp_path / "hf")
    lm = (trainer.policy if mode in ("grpo", "ppo") else trainer.model).eval()
    ids = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (AutoModelForCausalLM.from_pretrained(tmp_path / "hf")(ids).logits - lm(ids)).abs().max() < 1e-5


def test_the_stage_contract_is_held_at_import():
    """Every stage overrides only Stage's hooks, with its parameters; the Trainer (pretraining) defines every hook.
    A stage that overrides the loop, or a hook with other parameters, is refused when its class is checked."""
    from canntrain_core.stages import STAGES
    from canntrain_core.train.stage import HOOKS, Stage, parameters_of, check_stage
    from canntrain_core.train.trainer import Trainer

    assert {"build_data", "build_model", "train_iteration", "log_record", "evaluate", "extra_state"} <= HOOKS
    for name in HOOKS:
        assert parameters_of(vars(Trainer)[name]) == parameters_of(vars(Stage)[name]), name
    for stage in STAGES.values():
        check_stage(stage, Trainer)

    class OwnLoop(Trainer):
        def fit(self, stop_after=None):
            pass

    with pytest.raises(TypeError, match=r"OwnLoop.fit overrides the loop's Trainer.fit; a stage overrides only"):
        check_stage(OwnLoop, Trainer)

    class NoFill(Trainer):
        def build_model(self, config):
            pass

    with pytest.raises(TypeError, match=r"NoFill.build_model\(config\): the Stage hook is build_model\(config, fill\)"):
        check_stage(NoFill, Trainer)


def test_the_architecture_example_stage_holds_the_contract_and_resumes(fast_recipe, tmp_path):
    """ARCHITECTURE.md's example stage, run as written: its hooks log perplexity, and its state survives a resume."""
    import re

    from canntrain_core.train.stage import check_stage
    from canntrain_core.train.trainer import Trainer
    from conftest import ROOT

    text = (ROOT / "ARCHITECTURE.md").read_text()
    code = re.search(r"```python\n(.*?)```", text[text.index("class PerplexityTrainer") - 200 :], re.S).group(1)
    space: dict = {}
    exec(textwrap.dedent(code), space)
    stage = space["PerplexityTrainer"]
    check_stage(stage, Trainer)
    recipe = fast_recipe(**{"optim.max_steps": 4, "logging.eval_interval": 2, "logging.ckpt_interval": 2})
    stage(recipe, run_dir=tmp_path / "full", progress=False).fit()
    stage(recipe, run_dir=tmp_path / "cut", progress=False).fit(stop_after=2)
    resumed = stage(recipe, run_dir=tmp_path / "cut", resume_from="auto", progress=False)
    assert resumed.improved >= 1 and resumed.best < math.inf  # restored from the checkpoint
    resumed.fit()
    full, cut = ([r for r in read_metrics(tmp_path / d) if "val_perplexity" in r] for d in ("full", "cut"))
    assert [r["val_perplexity"] for r in full] == [math.exp(r["val_loss"]) for r in full]
    assert [r["val_improvements"] for r in full] == [r["val_improvements"] for r in cut]
