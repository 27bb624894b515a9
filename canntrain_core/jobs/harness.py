"""EleutherAI's lm-evaluation-harness on a canntrain model: ``canntrain eval`` and the tests' checks.

:class:`CanntrainLM` is the harness's ``LM`` interface over :func:`~canntrain_core.jobs.generate.load_generator`'s
model, so a run directory or a sharded DCP checkpoint evaluates as it is, with no export (the harness's own ``HFLM``
needs a transformers model; canntrain's model is its own class over transformers' blocks, with a ``tokenizers``
tokenizer). A Hugging Face directory loads the same way, and ``tests/jobs/test_harness.py`` checks the two
against ``HFLM`` on the export. Scoring follows ``HFLM``'s conventions: a continuation's tokens are those of
context + continuation past the context's own (the harness's ``_encode_pair``), no special tokens are added, an
empty context is conditioned on the BOS token (else the end token), and greedy means every continuation token is
the argmax.

``chat``: each request's context is the user turn of the model's chat template (what ``canntrain generate --chat``
encodes), for models fine-tuned on it; the harness's own ``--apply_chat_template`` needs a transformers tokenizer.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import datasets
import torch
from lm_eval import simple_evaluate
from lm_eval.api.model import TemplateLM
from lm_eval.tasks import TaskManager
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window, make_table

from canntrain_core.errors import BadInput
from canntrain_core.jobs.generate import Generator, load_generator
from canntrain_core.jobs.harness_tasks import PREFIX, task_kind, write_tasks
from canntrain_core.models.rollout import generate


class CanntrainLM(TemplateLM):
    """The harness's model interface over a canntrain :class:`~canntrain_core.jobs.generate.Generator`."""

    def __init__(self, generator: Generator, batch_size: int = 8, chat: bool = False):
        super().__init__()
        self.g, self.batch_size, self.chat = generator, batch_size, chat
        self.model_device = next(generator.model.parameters()).device

    # ---- tokens ----
    @property
    def eot_token_id(self) -> int:
        return self.g.eos_id

    @property
    def prefix_token_id(self) -> int:
        bos = self.g.tokenizer.token_to_id("<s>") or self.g.tokenizer.token_to_id("<|begin_of_text|>")
        return bos if bos is not None else self.eot_token_id

    @property
    def max_length(self) -> int:
        return self.g.model.config.max_position_embeddings

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.g.tokenizer.encode(string, add_special_tokens=bool(add_special_tokens)).ids

    def tok_decode(self, ids: list[int]) -> str:
        return self.g.tokenizer.decode(ids, skip_special_tokens=False)

    def _encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        if not self.chat:
            return super()._encode_pair(context, continuation)
        return self.g.prompt_ids(context, chat=True), self.tok_encode(continuation)

    # ---- scoring ----
    @torch.no_grad()
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """(log p(continuation | context), whether it is the greedy continuation) per request, in batches of
        ``batch_size`` rows right-padded to their longest (a causal model's earlier positions ignore the padding)."""
        rows = []
        for _, context, continuation in requests:
            whole = (context + continuation)[-(self.max_length + 1) :]
            rows.append((whole, min(len(continuation), len(whole) - 1)))
        out: list[tuple[float, bool]] = [(0.0, True)] * len(rows)  # an empty continuation: certain, and greedy
        order = sorted((i for i in range(len(rows)) if rows[i][1] > 0), key=lambda i: -len(rows[i][0]))
        for start in range(0, len(order), self.batch_size):
            batch = order[start : start + self.batch_size]
            width = max(len(rows[i][0]) for i in batch) - 1
            ids = torch.full((len(batch), width), self.eot_token_id, dtype=torch.long)
            for j, i in enumerate(batch):
                ids[j, : len(rows[i][0]) - 1] = torch.tensor(rows[i][0][:-1])
            logp = torch.log_softmax(self.g.model(ids.to(self.model_device)).float(), dim=-1)
            for j, i in enumerate(batch):
                whole, n = rows[i]
                span = slice(len(whole) - 1 - n, len(whole) - 1)  # the positions that predict the continuation
                target = torch.tensor(whole[-n:], device=logp.device)
                picked = logp[j, span].gather(-1, target[:, None]).squeeze(-1)
                out[i] = (float(picked.sum()), bool((logp[j, span].argmax(-1) == target).all()))
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """A document's log-likelihood over windows of the model's length (perplexity tasks), as ``HFLM`` cuts them."""
        totals = []
        for (text,) in (r.args for r in requests):
            windows = [
                make_disjoint_window(w)
                for w in get_rolling_token_windows(
                    self.tok_encode(text), self.prefix_token_id, self.max_length, context_len=1
                )
            ]
            scored = self._loglikelihood_tokens([(None, ctx, cont) for ctx, cont in windows])
            totals.append(sum(lp for lp, _ in scored))
        return totals

    # ---- generation ----
    @torch.no_grad()
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy continuations (the harness's default; ``do_sample`` is not taken), each cut at the first of its
        ``until`` strings, at most ``max_gen_toks`` tokens."""
        answers = []
        for context, kwargs in (r.args for r in requests):
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(kwargs.get("max_gen_toks", 256))
            ids = self.g.prompt_ids(context, chat=True) if self.chat else self.tok_encode(context)
            ids = ids[-max(1, self.max_length - max_new) :]
            row = generate(self.g.model, [ids], max_new, self.g.eos_id, 0.0, 0, stop_ids=self.g.end_ids)[0]
            end = next((i for i, t in enumerate(row) if t in self.g.end_ids), len(row))
            text = self.tok_decode(row[:end])
            for stop in until:
                text = text.split(stop)[0]
            answers.append(text)
        return answers


def task_manager(tasks: list[str], include_path: str | None, work: Path, n_items: int) -> TaskManager:
    """The harness's tasks with ``include_path``'s and, for ``canntrain_<kind>`` names, canntrain's own written
    into ``work/tasks``; a name the harness does not know is one line."""
    bad = [t for t in tasks if t.startswith(PREFIX) and task_kind(t) is None]
    if bad:
        raise BadInput(f"--tasks: {bad[0]} is no canntrain task (canntrain_reverse, _sort, _add, _upper)")
    paths = [str(Path(include_path).resolve())] if include_path else []
    ours = sorted({k for k in map(task_kind, tasks) if k})
    if ours:
        paths.append(str(write_tasks(Path(work) / "tasks", ours, n_items)))
    manager = TaskManager(include_path=paths or None, include_defaults=False) if paths else None
    if manager is None or any(t not in manager.all_tasks for t in tasks):  # the harness's own tasks (seconds)
        manager = TaskManager(include_path=paths or None)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        where = f" or in {include_path}" if include_path else " (--include-path adds a folder of YAML tasks)"
        raise BadInput(f"--tasks: {unknown[0]} is no task of the harness{where}")
    return manager


def evaluate(
    source: str | Path,
    tasks: list[str],
    include_path: str | None = None,
    limit: int | None = None,
    batch_size: int = 8,
    num_fewshot: int | None = None,
    chat: bool = False,
    n_items: int = 100,
    dtype: str = "fp32",
    work: str | Path | None = None,
) -> tuple[dict, str]:
    """The harness's results for ``tasks`` on ``source`` (JSON-ready: results, configs, versions, n-shot, samples
    counted) and its printed table."""
    manager = task_manager(tasks, include_path, Path(work or results_path(source)), n_items)
    lm = CanntrainLM(load_generator(source, dtype=dtype), batch_size=batch_size, chat=chat)
    harness_log = logging.getLogger("lm_eval")
    level, bars = harness_log.level, not datasets.are_progress_bars_disabled()
    harness_log.setLevel(logging.ERROR)  # its per-task progress lines; the table says what was run
    datasets.disable_progress_bars()  # loading a local task's JSONL is instant
    quiet = os.environ.get("TQDM_DISABLE")
    os.environ["TQDM_DISABLE"] = "1"  # the harness's bars over building requests: instant for these tasks
    try:
        out = simple_evaluate(
            model=lm, tasks=tasks, num_fewshot=num_fewshot, limit=limit, task_manager=manager, bootstrap_iters=1000
        )
    finally:
        if quiet is None:
            os.environ.pop("TQDM_DISABLE")
        else:
            os.environ["TQDM_DISABLE"] = quiet
        harness_log.setLevel(level)
        if bars:
            datasets.enable_progress_bars()
    kept = ("results", "configs", "versions", "n-shot", "higher_is_better", "n-samples")
    return {k: out[k] for k in kept if k in out}, make_table(out)


def results_path(source: Path) -> Path:
    """Where ``canntrain eval`` writes its JSON: the run directory's ``eval/`` (a checkpoint's run, when it lies
    in one), else the evaluated directory's."""
    source = Path(source).resolve()
    if source.parent.name == "checkpoints":
        source = source.parent.parent
    return source / "eval"
