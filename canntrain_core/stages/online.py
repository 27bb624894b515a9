"""What GRPO and PPO share: prompts, rollouts from the policy, the true score, greedy evaluation, the
iteration's bookkeeping. Each iteration is one ``step`` (one scheduler step, one metrics row).

The true score of a response is the programmatic check of the task (``finetune.tasks.partial_score``:
the share of the reference answer's items in place), which the notebooks plot beside whatever the
policy was trained on (a learned reward model's score, for PPO).
"""

from __future__ import annotations

import torch

from canntrain_core.finetune.tasks import partial_score, score
from canntrain_core.models.rollout import sample
from canntrain_core.finetune.alignment_data import build_prompt_data
from canntrain_core.train.trainer import Trainer


class OnlineTrainer(Trainer):
    formats_conversations = True
    policy: torch.nn.Module  # the model that generates (set by the stage's build_model)
    plot = "alignment"

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
        h = self.recipe.rlhf
        with self.compute():
            return sample(
                self.policy, [p for p, _ in prompts], n, h.generate_max_length, self.data.eos_id, temperature, h.top_k
            )

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
        """Each iteration's ``data.batch_size`` prompts, in the sampler's order."""
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
