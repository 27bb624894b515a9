"""vLLM as the rollout engine of GRPO and PPO (engines/): a real vLLM in its own environment (``make vllm-env``),
started by the trainer or attached to, on this CPU. ``make test-rollout-vllm`` runs these; ``make test`` leaves them
out (they need the vLLM environment, which the main one never does).

The tiny Llama fine-tuned on the sort task (the alignment notebooks' start) has head_dim 32, the least vLLM's CPU
attention takes. Its weights are fp32 and so are the engine's: the same tokens for greedy decoding, and the
log-probabilities of a sample within LOGPROB_TOL of the trainer's recomputation.
"""

from __future__ import annotations

import os
import signal

import pytest
import torch

from canntrain_core.engines.vllm_engine import SERVER, VLLMEngine, find_vllm_python
from canntrain_core.errors import RolloutEngineFailed
from canntrain_core.models.rollout import token_logprobs
from canntrain_core.recipe import load_recipe
from canntrain_core.stages import make_trainer
from canntrain_core.train.metrics import read_metrics
from conftest import CONFIGS

PYTHON = find_vllm_python()
pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(PYTHON is None, reason="no vLLM environment (make vllm-env)"),
]

LOGPROB_TOL = 1e-3  # fp32 both sides; measured: see the closing note of the test that asserts it
ENGINE = {
    "rlhf.rollout.backend": "vllm",
    "rlhf.rollout.enforce_eager": True,  # no compilation: a start of seconds, not minutes
    "rlhf.rollout.kv_cache_gib": 1,
}


def _grpo(start, tmp_path, resume_from=None, **extra):
    overrides = {
        "resume_from": resume_from,
        "model.init_from": str(start.sft_hf),
        "data.source": str(start.prompts),
        "data.batch_size": 4,
        "data.val_fraction": 0.0,
        "optim.max_steps": 4,
        "rlhf.ppo_epochs": 1,
        "rlhf.mini_batch_size": 16,
        "rlhf.rollout.python": PYTHON,
        **ENGINE,
        **extra,
    }
    return make_trainer(load_recipe(CONFIGS / "tiny_grpo.yaml", overrides), run_dir=tmp_path, progress=False)


def _engine_sample(trainer, prompts, n, temperature):
    h = trainer.recipe.rlhf
    eos = trainer.data.eos_id
    got = trainer.engine.submit(prompts, n, h.generate_max_length, temperature, 0, eos, eos, seed=0).result()
    return got


@pytest.mark.parametrize("weight_sync", ["files", "broadcast"])
def test_greedy_rollouts_equal_the_local_loop_before_and_after_a_weight_push(start, tmp_path, weight_sync):
    """files: the engine reloads safetensors the trainer wrote; broadcast: the tensors arrive over a gloo group
    between the trainer and vLLM's worker process, and nothing is written after the start."""
    trainer = _grpo(start, tmp_path, **{"rlhf.rollout.weight_sync": weight_sync})
    try:
        engine = trainer._start_engine()
        assert engine.version == 0
        prompts = trainer.data.train[:6]
        long = prompts[0][0] * 4  # past one KV-cache block: the prefix cache must not keep the old weights' keys
        prompts = [*prompts, (long[:60], prompts[0][1])]
        got = _engine_sample(trainer, prompts, 1, 0.0)
        assert got.version == 0
        assert got.rollout.responses == trainer.rollout(prompts, 1, 0.0).responses
        with torch.no_grad():  # new weights: every matrix moved
            for p in trainer.policy.parameters():
                p.add_(torch.randn_like(p) * 0.02)
        trainer.step = 1  # the version the push records
        written = {f: f.stat().st_mtime_ns for f in engine.weights.iterdir()}
        figures = trainer.push_weights()
        rewritten = {f: f.stat().st_mtime_ns for f in engine.weights.iterdir()}
        assert (rewritten == written) == (weight_sync == "broadcast")
        assert figures["timing_s/weight_sync"] > 0 and engine.version == 2
        after = _engine_sample(trainer, prompts, 1, 0.0)
        assert after.version == 2
        assert after.rollout.responses == trainer.rollout(prompts, 1, 0.0).responses
        assert after.rollout.responses != got.rollout.responses
        # sampled (temperature 1): the engine's log-probabilities of its own tokens against the trainer's
        sampled = _engine_sample(trainer, prompts, 4, 1.0)
        with torch.no_grad():
            mine = token_logprobs(trainer.policy, sampled.rollout.ids, 1.0)
        mask = sampled.rollout.mask.bool()
        diff = (mine - sampled.logprobs).abs()[mask]
        assert mask.sum() > 20 and diff.max() < LOGPROB_TOL, float(diff.max())
        if weight_sync == "broadcast":  # an engine that cannot take what it is sent: one line, not a wait for ever
            bad = [("model.embed_tokens.weight", [3, 5]), ("model.norm.weight", [5])]
            with pytest.raises(RolloutEngineFailed, match="refused /receive_weights"):
                engine.send_weights(bad, iter([torch.zeros(3, 5), torch.zeros(5)]), 3)
    finally:
        trainer.close()
    assert trainer.engine.proc.poll() is not None  # the run's engine stops with it


def test_grpo_one_step_off_policy_divides_by_the_sampling_weights_probabilities(start, tmp_path):
    """staleness 0: the ratio's denominator is the trainer's own recomputation on the weights that sampled, so the
    first (only) mini-batch's ppo_kl is 0. staleness 1: the batch was sampled by the weights before the last update,
    the denominator is the engine's log-probability, and ppo_kl measures that step of drift."""
    runs = {}
    for staleness in (0, 1):
        trainer = _grpo(start, tmp_path / f"s{staleness}", **{"rlhf.rollout.staleness": staleness})
        trainer.fit()
        runs[staleness] = {r["step"]: r for r in read_metrics(trainer.run_dir)}
    on, off = runs[0], runs[1]
    assert [on[s]["rollout/staleness"] for s in (1, 2, 3, 4)] == [0, 0, 0, 0]
    assert [off[s]["rollout/staleness"] for s in (1, 2, 3, 4)] == [0, 1, 1, 1]
    assert all(abs(on[s]["actor/ppo_kl"]) < 1e-6 for s in (1, 2, 3, 4))
    assert all(abs(off[s]["actor/ppo_kl"]) > 1e-5 for s in (2, 3, 4)), [off[s]["actor/ppo_kl"] for s in off]
    for s in (1, 2, 3, 4):
        assert on[s]["training/rollout_probs_diff_max"] < 1e-3
        assert off[s]["timing_s/gen"] > 0 and off[s]["timing_s/gen_wait"] >= 0
        assert "timing_s/weight_sync" in off[s] and "timing_s/gen_overlap" in off[s]


def test_a_killed_engine_is_one_line_and_a_resume_reloads_it_from_the_checkpoint(start, tmp_path):
    ckpt = {"logging.ckpt_interval": 2}
    first_run = _grpo(start, tmp_path, **ckpt)
    first_run.fit(stop_after=2)
    first_run.close()
    resumed = _grpo(start, tmp_path, **ckpt, resume_from="auto")
    assert resumed.step == 2
    batches = resumed.batches()
    first = next(batches)  # the engine starts on the checkpoint's weights
    prompts = resumed.data.train[:4]
    greedy = _engine_sample(resumed, prompts, 1, 0.0)
    assert greedy.version == 2 and greedy.rollout.responses == resumed.rollout(prompts, 1, 0.0).responses
    os.killpg(resumed.engine.proc.pid, signal.SIGKILL)
    resumed.engine.proc.wait()
    with pytest.raises(RolloutEngineFailed) as e:  # its sample, or the weight push after the update
        resumed.train_iteration(first)
    message = str(e.value)
    assert "\n" not in message and "vLLM rollout process" in message and "exited with code -9" in message
    assert f"The last complete checkpoint is {tmp_path / 'checkpoints' / 'step_2'}" in message, message
    resumed.close()
    # the next attempt: the engine starts again from the checkpoint and the run goes on to its end
    again = _grpo(start, tmp_path, **ckpt, resume_from="auto")
    again.fit()
    again.close()
    assert [r["step"] for r in read_metrics(tmp_path) if "true_score/mean" in r] == [1, 2, 3, 4]


def test_the_server_runs_alone_from_its_path():
    """The server needs nothing of canntrain's environment: its --help works under the vLLM interpreter alone."""
    import subprocess

    out = subprocess.run([PYTHON, str(SERVER), "--help"], capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"})
    assert out.returncode == 0 and "--model" in out.stdout


def test_an_engine_that_cannot_start_is_one_line(tmp_path):
    recipe = load_recipe(
        CONFIGS / "tiny_grpo.yaml", {"model.init_from": str(tmp_path), "rlhf.rollout.python": PYTHON, **ENGINE}
    )
    engine = VLLMEngine(recipe.rlhf.rollout, "fp32", tmp_path, "cpu", 0, 0)
    engine.weights.mkdir(parents=True)  # no config.json: vLLM refuses it
    with pytest.raises(RolloutEngineFailed) as e:
        engine.start()
    assert "\n" not in str(e.value) and "exited with code" in str(e.value) and str(engine.log_path) in str(e.value)


def test_an_engine_stops_when_the_trainer_that_started_it_is_killed(start, tmp_path):
    """SIGKILL leaves a trainer no chance to stop its engine, which would hold its devices: the server watches the
    process that started it and ends its own process group (itself and vLLM's processes) once it is gone."""
    import subprocess
    import sys
    import time

    trainer = (
        "import subprocess, sys\n"
        "import os\n"
        f"p = subprocess.Popen([{PYTHON!r}, {str(SERVER)!r}, '--model', {str(start.sft_hf)!r}, '--port', '0',"
        " '--enforce-eager', '--single-process', '--kv-cache-gib', '1', '--parent-pid', str(os.getpid())],"
        " start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
        "print(p.pid, flush=True)\n"
        "p.wait()\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", trainer], stdout=subprocess.PIPE, text=True)
    server = int(parent.stdout.readline())
    time.sleep(3)  # the server is loading the model
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and os.path.exists(f"/proc/{server}") and "Z" not in _state(server):
        time.sleep(0.5)
    assert not os.path.exists(f"/proc/{server}") or "Z" in _state(server), "the engine outlived its trainer"


def _state(pid: int) -> str:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"
