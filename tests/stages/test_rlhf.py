"""Alignment stages end to end: rollouts, the reward model, PPO (shared and separated), GRPO, DPO.

The arithmetic (GAE, clipping, KL, DPO, group advantages) is checked by hand in test_rlhf_math.py;
here the stages run on the tiny model, fine-tuned on the verifiable task (conftest's ``sft_model``).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from canntrain_core.errors import OutOfMemory
from canntrain_core.jobs.layouts import launch_layouts, run_layouts
from canntrain_core.models.generate import greedy
from canntrain_core.models.lifecycle import build_training_model
from canntrain_core.models.registry import model_config
from canntrain_core.models.rollout import generate, layout, token_logprobs
from canntrain_core.recipe import load_recipe
from canntrain_core.jobs.alignment_start import trained
from canntrain_core.stages import make_trainer
from canntrain_core.stages.grpo import GRPOTrainer
from canntrain_core.train.metrics import read_metrics
from canntrain_core.train.trainer import runs_root
from conftest import rows_by_step, CONFIGS, TINY


WORKDIR = runs_root() / "rlhf"  # the alignment notebooks' workdir under the suite's $CANNTRAIN_RUNS

# the notebooks' settings: their recipes are trained once, here or there (jobs.alignment_start.trained)
REWARD_STEPS = 100
ONLINE_STEPS = {"grpo": 30, "ppo": 20}


def test_cached_generation_of_left_padded_prompts_equals_one_prompt_at_a_time():
    recipe = load_recipe(TINY, {"data.tokenizer.vocab_size": 300})
    model = build_training_model(recipe, model_config(recipe.model, 300), torch.device("cpu")).model.eval()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (3, 9, 5, 1)]
    cached = generate(model, prompts, 8, pad_id=0, temperature=0.0)
    assert cached == [greedy(model, p, 8) for p in prompts]  # greedy(): no cache, no padding
    # the sampled tokens' log-probabilities: cached decode vs a plain forward pass of the whole rows
    ro = layout(prompts, cached, eos_id=-1, pad_id=0)
    with torch.no_grad():
        full = token_logprobs(model, ro.ids)
        logits = model(ro.ids[:1, :-1])
    assert full.shape == ro.mask.shape and torch.isfinite(full).all()
    assert torch.allclose(full[0], torch.log_softmax(logits[0], -1).gather(-1, ro.ids[0, 1:, None])[:, 0], atol=1e-6)


# ---------------------------------------------------------------- the stages on the fine-tuned tiny model
TEMPLATE = {
    "data.seq_length": 32,
    "data.template.user": "{content} =",
    "data.template.assistant": " {content}{eos}",
    "optim.weight_decay": 0.0,
    "logging.log_interval": 1,
}


@pytest.fixture(scope="module")
def reward_run(start) -> Path:
    """``rlhf_ppo.ipynb``'s reward model."""
    recipe = load_recipe(
        CONFIGS / "tiny_reward.yaml",
        {
            "model.init_from": str(start.sft_hf),
            "data.source": str(start.pairs),
            "optim.max_steps": REWARD_STEPS,
            "logging.eval_interval": REWARD_STEPS,
            "logging.ckpt_interval": REWARD_STEPS,
        },
    )
    return trained(recipe, WORKDIR, "reward").run_dir


def test_the_reward_model_orders_held_out_pairs_well_above_chance(reward_run):
    acc = [r["val_accuracy"] for r in read_metrics(reward_run) if "val_accuracy" in r]
    # 128 held-out pairs. Measured 0.53 -> 0.66 in 100 steps (0.62 -> 0.89 and 0.41 -> 0.72 on two other orders of
    # the pretraining data): the untrained head is not at chance (a random projection of the SFT model's last hidden
    # state already prefers some right answers), and the trained one is well above it.
    assert acc[-1] >= 0.62 and acc[-1] >= acc[0] + 0.08, acc


def _ppo(start, reward_run, data_cache, **extra) -> dict:
    return {
        **TEMPLATE,
        "train_mode": "ppo",
        "model.init_from": str(start.sft_hf),
        "data.source": str(start.prompts),
        "data.cache_dir": data_cache,
        "data.batch_size": 8,
        "data.val_fraction": 0.03,
        "optim.lr": 1e-4,
        "optim.warmup_steps": 0,
        "optim.max_steps": 4,
        "logging.eval_interval": 2,
        "logging.eval_exact_match": 8,
        "logging.ckpt_interval": 2,
        "rlhf.generate_max_length": 12,
        "rlhf.mini_batch_size": 4,
        "rlhf.ppo_epochs": 2,
        "rlhf.reward_model": str(reward_run),
        **extra,
    }


def test_ppo_resume_is_bit_exact_and_resident_memory_is_the_estimate(start, reward_run, tmp_path, data_cache):
    from canntrain_core.memory.alignment import estimate_alignment, measure_resident

    recipe = load_recipe(None, _ppo(start, reward_run, data_cache, **{"rlhf.target_kl": 0.05}))
    whole = make_trainer(recipe, run_dir=tmp_path / "whole", progress=False)
    whole.fit()
    make_trainer(recipe, run_dir=tmp_path / "cut", progress=False).fit(stop_after=2)
    make_trainer(recipe, run_dir=tmp_path / "cut", resume_from="auto", progress=False).fit()
    full, cut = rows_by_step(tmp_path / "whole"), rows_by_step(tmp_path / "cut")
    assert sorted(full) == [0, 1, 2, 3, 4] and full == cut  # scores, KL, losses, the adaptive KL coefficient
    assert full[4]["actor/reward_kl_penalty_coeff"] != 0.02  # the controller moved it (the resumed run restored it)
    # four models, each holding what the estimator says (fp32 parameters, + gradients + AdamW states)
    est = {r.name: r.states for r in estimate_alignment(recipe).roles}
    assert measure_resident(whole) == est and set(est) == {"actor", "critic", "reference", "reward"}


def test_separated_placement_on_its_own_rank_matches_shared(start, reward_run, tmp_path, data_cache):
    base = _ppo(start, reward_run, data_cache, **{"optim.max_steps": 3, "logging.ckpt_interval": 3})
    launch_layouts(
        TINY, tmp_path, 2, base, {"separated": {"rlhf.device_placement": "separated", "distributed.world_size": 1}}
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each launched rank: the same reduction order, the same samples
    try:
        run_layouts(str(TINY), tmp_path, base, ["shared={}"])
    finally:
        torch.set_num_threads(threads)
    shared, separated = rows_by_step(tmp_path / "shared"), rows_by_step(tmp_path / "separated")
    assert sorted(shared) == [0, 1, 2, 3]
    for step in shared:
        for k, v in shared[step].items():
            assert separated[step][k] == pytest.approx(v, rel=1e-5, abs=1e-6), (step, k)


def _mean(rows: list[float]) -> float:
    return sum(rows) / len(rows)


@pytest.mark.parametrize("stage", ["grpo", "ppo"])
def test_grpo_and_ppo_raise_the_true_score(stage, start):
    """From the 100-step SFT model, on sort prompts, rewarded by the checker: the shipped tiny recipes as
    ``grpo.ipynb`` and ``rlhf_ppo.ipynb`` run them. Measured (mean true score of the 64 sampled answers per
    iteration, first -> last 6 iterations, of 30 for GRPO, 20 for PPO): GRPO 0.208 -> 0.277, PPO 0.210 -> 0.270."""
    recipe = load_recipe(
        CONFIGS / f"tiny_{stage}.yaml",
        {
            "model.init_from": str(start.sft_hf),
            "data.source": str(start.prompts),
            "optim.max_steps": ONLINE_STEPS[stage],
        },
    )
    run = trained(recipe, WORKDIR, {"grpo": "grpo", "ppo": "ppo_true"}[stage]).run_dir
    scores = [r["true_score/mean"] for r in read_metrics(run) if "true_score/mean" in r]
    assert len(scores) == ONLINE_STEPS[stage]
    assert _mean(scores[-6:]) >= _mean(scores[:6]) + 0.04, (_mean(scores[:6]), _mean(scores[-6:]))


def _small_grpo(start, data_cache, **extra):
    """3 iterations of 4 prompts, one update each: the engine's handling, not learning, is what is tested."""
    overrides = {
        "model.init_from": str(start.sft_hf),
        "data.source": str(start.prompts),
        "data.cache_dir": data_cache,
        "data.batch_size": 4,
        "data.val_fraction": 0.0,
        "optim.max_steps": 3,
        "rlhf.ppo_epochs": 1,
        "rlhf.mini_batch_size": 8,
    }
    return load_recipe(CONFIGS / "tiny_grpo.yaml", {**overrides, **extra})


def test_grpo_skips_a_nan_update_and_logs_the_engines_health(start, tmp_path, data_cache):
    """The online stages share the engine's optimizer step and its health: a NaN gradient in iteration 2's
    first update is skipped (optim.nonfinite: skip) and counted in every later row, with the step breakdown."""

    class NaNAtIteration2(GRPOTrainer):
        def optimizer_step(self):
            if self.step + 1 == 2 and not self.health.skipped_steps:
                next(p for p in self.model.parameters() if p.grad is not None).grad.fill_(float("nan"))
            return super().optimizer_step()

    recipe = _small_grpo(start, data_cache, **{"optim.nonfinite": "skip", "logging.profile.enabled": True})
    NaNAtIteration2(recipe, run_dir=tmp_path, progress=False).fit()
    rows = [r for r in read_metrics(tmp_path) if "actor/pg_loss" in r]
    assert [r.get("skipped_steps", 0) for r in rows] == [0, 1, 1]
    assert all(r["time/optimizer"] > 0 for r in rows)
    assert all(math.isfinite(r["actor/pg_loss"]) for r in rows)


def test_an_out_of_memory_in_a_grpo_iteration_gets_the_engines_diagnosis(start, tmp_path, data_cache):
    """Every stage's step runs inside the engine's out-of-memory handling: an allocation failing in iteration 2's
    rollout (as a device's would) ends the run with the step, the estimate against the capacity and the checkpoint."""

    class FailsAtIteration2(GRPOTrainer):
        def rollout(self, prompts, n, temperature):
            if self.step + 1 == 2:
                raise torch.OutOfMemoryError("out of memory: tried to allocate 2.00 GiB")
            return super().rollout(prompts, n, temperature)

    recipe = _small_grpo(start, data_cache, **{"logging.ckpt_interval": 1})
    said = r"(?s)step 2: out of memory: tried .*the estimate for this recipe is .* per device "
    said += r".*The last complete checkpoint is \S*step_1\."
    with pytest.raises(OutOfMemory, match=said):
        FailsAtIteration2(recipe, run_dir=tmp_path, progress=False).fit()


def test_dpo_moves_the_held_out_margins(start, tmp_path, data_cache):
    recipe = load_recipe(
        CONFIGS / "tiny_dpo.yaml",
        {
            "model.init_from": str(start.sft_hf),
            "data.source": str(start.pairs),
            "data.cache_dir": data_cache,
            "optim.max_steps": 30,
            "logging.eval_interval": 30,
            "logging.ckpt_interval": 30,
        },
    )
    make_trainer(recipe, run_dir=tmp_path / "dpo", progress=False).fit()
    first, last = (r for r in read_metrics(tmp_path / "dpo") if "val_rewards/accuracies" in r)
    assert first["val_rewards/accuracies"] == 0.0 and first["val_loss"] == pytest.approx(math.log(2), abs=1e-6)
    # measured on this order of the pretraining data: accuracy 0.66, loss log 2 - 0.039 (the previous order passed
    # 0.65 and log 2 - 0.05): well off chance (0.5, log 2), by less than a pinned realization would suggest
    assert last["val_rewards/accuracies"] >= 0.62 and last["val_loss"] < math.log(2) - 0.03, last


def test_canntrain_start_makes_what_the_tiny_recipes_read(start, tmp_path, data_cache, monkeypatch, capfd):
    """`canntrain start` puts the cached start where the shipped recipes look (cwd/runs): tiny_sft.yaml and
    tiny_grpo.yaml then train as they are; a second call keeps what is there. (The command line in this process,
    from tmp_path as its working directory.)"""
    from canntrain_core.cli import main

    monkeypatch.chdir(tmp_path)
    capfd.readouterr()
    assert main(["start", "--cache", str(WORKDIR), "--configs", str(CONFIGS)]) == 0, capfd.readouterr().err[-2000:]
    assert {p.name for p in (tmp_path / "runs").iterdir()} >= {
        "tiny_pretrained_hf",
        "tiny_sft_hf",
        "tasks.jsonl",
        "prompts.jsonl",
        "pairs.jsonl",
    }
    for recipe in ("tiny_sft.yaml", "tiny_grpo.yaml"):
        args = ["train", str(CONFIGS / recipe), "--no-progress", "--run-dir", f"runs/{recipe}"]
        args += ["--set", "optim.max_steps=1", "--set", "logging.eval_exact_match=8"]
        assert main(args + ["--set", f"data.cache_dir={data_cache}"]) == 0, capfd.readouterr().err[-2000:]
    capfd.readouterr()
    assert main(["start", "--cache", str(WORKDIR), "--configs", str(CONFIGS)]) == 0
    assert capfd.readouterr().out.count("exists, kept") == 5
