"""What GRPO and PPO share: prompts, rollouts from the policy, the true score, greedy evaluation, the
iteration's bookkeeping. Each iteration is one ``step`` (one scheduler step, one metrics row).

The true score of a response is the programmatic check of the task (``finetune.tasks.partial_score``:
the share of the reference answer's items in place), which the notebooks plot beside whatever the
policy was trained on (a learned reward model's score, for PPO).
"""

from __future__ import annotations

import time
from collections import deque
from concurrent.futures import Future

import torch

from canntrain_core.checkpoint.live import live_tensors, write_live_weights
from canntrain_core.engines.vllm_engine import VLLM_DTYPES, EngineSample, VLLMEngine
from canntrain_core.errors import RolloutEngineFailed
from canntrain_core.finetune.alignment_data import build_prompt_data
from canntrain_core.finetune.tasks import partial_score, score
from canntrain_core.models.rollout import sample
from canntrain_core.runtime.accelerator import DTYPES
from canntrain_core.train.health import checkpoint_sentence
from canntrain_core.train.trainer import Trainer


class OnlineTrainer(Trainer):
    formats_conversations = True
    policy: torch.nn.Module  # the model that generates (set by the stage's build_model)
    plot = "alignment"
    samples_per_prompt = 1  # responses sampled per prompt in training (GRPO: rlhf.group_size)

    @staticmethod
    def rows(recipe) -> tuple[int, int]:
        h = recipe.rlhf
        return h.mini_batch_size, recipe.data.batch_size * h.group_size

    def build_data(self, config):
        r = self.recipe
        return build_prompt_data(
            r.data, r.experiment.seed, r.rlhf.generate_max_length, *self.dp, **self.tokenizer_args(config)
        )

    def compute(self):
        """Autocast to the recipe's precision (fp32: nothing): what every forward of a stage runs under."""
        return self.acc.autocast(self.recipe.model.precision)

    def rollout(self, prompts, n: int, temperature: float):
        """``n`` responses to each prompt from the policy as it is now, sampled in this process (evaluation's, and
        the training rollouts of ``rlhf.rollout.backend: local``)."""
        h = self.recipe.rlhf
        with self.compute():
            return sample(
                self.policy, [p for p, _ in prompts], n, h.generate_max_length, self.data.eos_id, temperature, h.top_k
            )

    # ---- the training rollouts: this process's loop, or a vLLM engine beside it ----
    engine: VLLMEngine | None = None  # rlhf.rollout.backend vllm: started at the first batch, stopped by close()

    def sampled(self, batch, n: int, temperature: float) -> tuple[list, object, dict]:
        """The prompts of ``batch`` (what ``batches`` gave), their ``n`` responses each, and the rollout's figures:
        sampled here, or the engine's sample waited for (``timing_s/gen_wait``; its own time ``timing_s/gen``, the
        overlap with the previous update ``timing_s/gen_overlap``, the weights' age ``rollout/staleness``)."""
        if not isinstance(batch, Future):
            started = time.perf_counter()
            ro = self.rollout(batch, n, temperature)
            return batch, ro, {"timing_s/gen": time.perf_counter() - started}
        started = time.perf_counter()
        got: EngineSample = self._engine_call(batch.result)
        waited = time.perf_counter() - started
        ro = got.rollout
        ro.logprobs, ro.version = got.logprobs, got.version
        return (
            got.prompts,
            ro,
            {
                "timing_s/gen": got.seconds,
                "timing_s/gen_wait": waited,
                "timing_s/gen_overlap": max(0.0, got.seconds - waited),
                "rollout/staleness": self.step - got.version,
            },
        )

    def behaviour_logprobs(self, ro, recomputed: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """The log-probabilities the importance ratio divides by: the trainer's recomputation on the sampling
        weights (on-policy: ``recomputed``, as verl recomputes ``old_log_prob``), or the engine's own when the
        weights have moved on since (``rlhf.rollout.staleness`` > 0). With an engine, how far its probabilities
        are from the trainer's on the same tokens (verl's ``training/rollout_probs_diff_*``)."""
        if ro.logprobs is None:
            return recomputed, {}
        engine = ro.logprobs.to(recomputed.device)
        diff = (engine.exp() - recomputed.exp()).abs()[mask.bool()]
        figures = {
            "training/rollout_probs_diff_max": float(diff.max()),
            "training/rollout_probs_diff_mean": float(diff.mean()),
        }
        return (engine if ro.version != self.step else recomputed), figures

    def push_weights(self) -> dict:
        """After an update the engine reloads the policy (all ranks gather, rank 0 writes): ``timing_s/weight_sync``."""
        if self.engine is None:
            return {}
        started = time.perf_counter()
        if self.recipe.rlhf.rollout.weight_sync == "broadcast":
            params, tensors = live_tensors(self.policy, self.model_config, self._engine_dtype(), self.acc.device)
            self._engine_call(self.engine.send_weights, params, tensors, self.step + 1)
        else:
            self._write_policy(with_config=False)
            if self.rank == 0:
                self._engine_call(self.engine.load, self.step + 1)
        if torch.distributed.is_initialized():
            torch.distributed.barrier()  # no rank asks for the next batch before the engine holds the new weights
        return {"timing_s/weight_sync": time.perf_counter() - started}

    def _engine_dtype(self) -> torch.dtype:
        return DTYPES[{v: k for k, v in VLLM_DTYPES.items()}[self.engine.dtype]]  # vLLM's name back to the recipe's

    def _write_policy(self, with_config: bool) -> None:
        write_live_weights(
            self.policy, self.model_config, self.engine.weights, self._engine_dtype(), self.rank == 0, with_config
        )

    def _engine_call(self, fn, *args):
        try:
            return fn(*args)
        except RolloutEngineFailed as e:
            raise RolloutEngineFailed(f"{e}. {checkpoint_sentence(self._last_checkpoint())}") from e

    def _start_engine(self) -> VLLMEngine:
        h, r = self.recipe.rlhf, self.recipe
        self.engine = VLLMEngine(h.rollout, r.model.precision, self.run_dir, self.acc.device.type, self.rank, self.step)
        self._write_policy(with_config=True)
        self._engine_call(self.engine.start)
        if h.rollout.url and self.rank == 0:  # a server started elsewhere holds other weights: this run's, now
            self._engine_call(self.engine.load, self.step)
        if h.rollout.weight_sync == "broadcast" and self.rank == 0:
            self._engine_call(self.engine.join_weight_group)
        return self.engine

    def _engine_batches(self, n: int):
        """Prompt batches as Futures of the engine's samples, ``rlhf.rollout.staleness`` batches ahead: the next
        batch is being sampled while this one trains. The sampler advances as each is handed out, so a checkpoint
        records only the batches trained (a resume samples the rest again, on the checkpoint's weights)."""
        h, r = self.recipe.rlhf, self.recipe
        engine = self._start_engine()
        source, ahead = self.data.prompt_batches(), deque()
        while True:
            while len(ahead) <= h.rollout.staleness:
                prompts = next(source)
                seed = (r.experiment.seed * 1_000_003 + (self.step + len(ahead)) * 1_009 + self.rank) % 2**31
                ahead.append(
                    self._engine_call(
                        engine.submit,
                        prompts,
                        n,
                        h.generate_max_length,
                        h.temperature,
                        h.top_k,
                        self.data.eos_id,
                        self.data.eos_id,
                        seed,
                    )
                )
            done = ahead.popleft()
            self.data.sampler.advance(r.data.batch_size)
            yield done

    def close(self) -> None:
        """Stop the rollout engine this run started."""
        if self.engine is not None:
            self.engine.close()

    def true_scores(self, ro, prompts, n: int = 1) -> torch.Tensor:
        """The programmatic score of every response (``n`` per prompt, in the rollout's order)."""
        refs = [a for _, a in prompts for _ in range(n)]
        return torch.tensor([partial_score(self.data.answer_text(resp), ref) for resp, ref in zip(ro.responses, refs)])

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Greedy answers to the held-out prompts (``logging.eval_exact_match`` of them, default 32):
        mean true score and exact match; none when ``data.val_fraction`` is 0."""
        if not self.data.val:
            return {}
        with self.compute():
            return heldout_scores(
                self.policy, self.data, self.recipe.logging.eval_exact_match or 32, self.recipe.rlhf.generate_max_length
            )

    def samples(self, n: int = 4) -> list[tuple[str, str, str]]:
        """(prompt, greedy answer, reference) for the first ``n`` held-out prompts: what the numbers mean."""
        prompts = self.data.val[:n]
        ro = self.rollout(prompts, 1, 0.0)
        return [(self.data.decode(p), self.data.answer_text(r), ref) for (p, ref), r in zip(prompts, ro.responses)]

    def batches(self):
        """Each iteration's ``data.batch_size`` prompts, in the sampler's order; with a vLLM engine, the Future of
        their samples."""
        if self.recipe.rlhf.rollout.backend == "vllm":
            return self._engine_batches(self.samples_per_prompt)
        return self.data.train_loader()

    def log_record(self, raw: dict, last: bool) -> dict:
        """The iteration's metrics at ``logging.log_interval``s: every rank holds the same ``raw`` up to its own
        rollout, so scalar metrics are averaged over data-parallel ranks (``*/max`` and ``*/min`` are the
        extremes over them), with the engine's ``health`` (skipped steps, gradient norm spikes, ``time/*``)."""
        return self._logged(raw) if self.step % self.recipe.logging.log_interval == 0 or last else {}

    def with_evaluation(self, record: dict, raw: dict) -> dict:
        """An evaluated step is logged with its metrics, whatever the log interval."""
        found = self.evaluate()
        return {**(record or (self._averaged(raw) if found else {})), **found}

    def _logged(self, raw: dict) -> dict:
        return {**self._averaged(raw), **self.health.take(*self.throughput.take())}

    def postfix(self, raw: dict, record: dict) -> dict:
        return {"score": f"{raw['true_score/mean']:.3f}"}

    def _averaged(self, record: dict) -> dict:
        if self.dims.dp == 1:
            return record
        keys = sorted(
            k
            for k in record
            if not k.startswith(("val_", "timing_s/", "lr", "actor/reward_kl_penalty_coeff", "actor/kl_coef"))
        )
        means = [k for k in keys if not k.endswith(("/max", "/min"))]
        sign = {k: -1.0 if k.endswith("/min") else 1.0 for k in keys if k not in means}  # min = -max(-x)
        values = torch.tensor([float(record[k]) for k in means], device=self.acc.device)
        torch.distributed.all_reduce(values)
        out = {**record, **{k: v / torch.distributed.get_world_size() for k, v in zip(means, values.tolist())}}
        if sign:
            extremes = torch.tensor([sign[k] * float(record[k]) for k in sign], device=self.acc.device)
            torch.distributed.all_reduce(extremes, op=torch.distributed.ReduceOp.MAX)
            out.update({k: sign[k] * v for k, v in zip(sign, extremes.tolist())})
        return out


@torch.no_grad()
def heldout_scores(policy, data, n: int, max_new: int) -> dict[str, float]:
    """``val_score`` (mean true score) and ``val_exact_match`` of ``policy``'s greedy answers to the first ``n``
    held-out prompts of a :class:`~canntrain_core.finetune.alignment_data.PromptBundle`: any policy, any stage
    (DPO's too)."""
    prompts = data.val[:n]
    ro = sample(policy, [p for p, _ in prompts], 1, max_new, data.eos_id, 0.0)
    answers = [data.answer_text(r) for r in ro.responses]
    return {
        "val_score": sum(partial_score(a, ref) for a, (_, ref) in zip(answers, prompts)) / len(prompts),
        "val_exact_match": sum(score(a, ref) for a, (_, ref) in zip(answers, prompts)) / len(prompts),
    }
