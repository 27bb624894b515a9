"""``logging.eval_tasks``: the harness on the trainer's live model at each evaluation, logged beside ``val_loss`` as
``eval/<task>/<metric>`` (OLMo-core's in-loop downstream evaluation, with the harness's tasks).

Every rank runs the same items and makes the same forward passes (the model's collectives, FSDP's gathers and TP's
reductions, line up; ``models.rollout.generate`` stops when every rank's answers have ended); the harness keeps the
results on each node's LOCAL_RANK 0 only, and rank 0 logs them. canntrain's tasks are written into a folder of this
process's own (each node has one, whatever the run directory is). Rows per forward: ``data.batch_size``, each at
most ``data.seq_length`` tokens: the forward's logits are [rows, tokens, vocab] in the model's dtype (1 GiB a
4,096-token row of a 128k vocabulary in bf16), and each continuation is scored in fp32 over its own positions only."""

from __future__ import annotations

import tempfile
from pathlib import Path

from canntrain_core.evaluation.harness_lm import CanntrainLM, ModelView
from canntrain_core.evaluation.harness_run import flat_scores, run_tasks, task_manager


class InLoopTasks:
    """The harness's tasks of a recipe's ``logging`` over ``model`` (tokenized as ``data``; in its chat template
    when ``chat``)."""

    def __init__(self, model, data, logging_config, batch_size: int, max_length: int, chat: bool):
        self.tasks, self.limit = list(logging_config.eval_tasks), logging_config.eval_tasks_limit
        self.work = tempfile.TemporaryDirectory(prefix="canntrain-eval-tasks-")  # removed with this object
        self.manager = task_manager(
            self.tasks,
            logging_config.eval_include_path,
            Path(self.work.name),
            self.limit,
            key="logging.eval_tasks",
            include_key="logging.eval_include_path",
        )
        prompt = (lambda text: data.format.prompt((("user", text),))) if chat else None
        view = ModelView(model, data.tokenizer, data.eos_id, (data.eos_id,), max_length, prompt)
        self.lm = CanntrainLM(view, batch_size=batch_size, chat=chat)

    def __call__(self) -> dict[str, float]:
        """``eval/<task>/<metric>`` for every task, ``logging.eval_tasks_limit`` items each ({} where the harness kept
        no results: a rank past each node's first)."""
        return flat_scores(run_tasks(self.lm, self.tasks, self.manager, self.limit))
