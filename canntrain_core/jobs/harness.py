"""``canntrain eval``'s work: lm-evaluation-harness on a saved model (a run directory, a DCP checkpoint or a Hugging
Face directory, loaded by :func:`~canntrain_core.jobs.generate.load_generator`) through canntrain's own ``LM``
(``evaluation/harness_lm.py``: no export needed), the results kept beside the run."""

from __future__ import annotations

from pathlib import Path

from lm_eval.utils import make_table

from canntrain_core.evaluation.harness_lm import CanntrainLM, ModelView
from canntrain_core.evaluation.harness_run import KEPT, run_tasks, task_manager
from canntrain_core.jobs.generate import Generator, load_generator


def model_view(g: Generator, max_length: int | None = None) -> ModelView:
    """The harness's view of a loaded model: its chat template as the chat prompt, when it has one; ``max_length``
    tokens per row (default: the model's positions, as ``HFLM``'s)."""
    chat = (lambda text: g.prompt_ids(text, chat=True)) if g.format is not None else None
    length = max_length or g.model.config.max_position_embeddings
    return ModelView(g.model, g.tokenizer, g.eos_id, g.end_ids, length, chat)


def language_model(
    source: str | Path, batch_size: int = 8, chat: bool = False, dtype: str = "fp32", max_length: int | None = None
) -> CanntrainLM:
    """The harness's ``LM`` over ``source``'s model; ``chat`` without a chat template is one line."""
    g = load_generator(source, dtype=dtype)
    if chat:
        g.prompt_ids("", chat=True)  # no template: the --chat line of canntrain generate
    return CanntrainLM(model_view(g, max_length), batch_size=batch_size, chat=chat)


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
    max_length: int | None = None,
) -> tuple[dict, str]:
    """The harness's results for ``tasks`` on ``source`` (JSON-ready: results, configs, versions, n-shot, samples
    counted) and its printed table."""
    manager = task_manager(tasks, include_path, Path(work or results_path(source)), n_items)
    lm = language_model(source, batch_size, chat, dtype, max_length)
    out = run_tasks(lm, tasks, manager, limit, num_fewshot)
    return {k: out[k] for k in KEPT if k in out}, make_table(out)


def results_path(source: Path) -> Path:
    """Where ``canntrain eval`` writes its JSON: the run directory's ``eval/`` (a checkpoint's run, when it lies
    in one), else the evaluated directory's."""
    source = Path(source).resolve()
    if source.parent.name == "checkpoints":
        source = source.parent.parent
    return source / "eval"
