"""The same online recipe with each rollout engine: this process's loop, and vLLM on-policy and one step off.

What ``grpo.ipynb`` and ``benchmarks/rollout_backends.py`` show: the true score's curve (the engines cannot draw the
same samples from the same seeds, so the curves agree in distribution, not token for token) and where an iteration's
time goes. ``timing_s/gen`` is the engine's own time on a batch, ``timing_s/gen_wait`` the trainer's wait for it
(local: the whole generation), ``timing_s/gen_overlap`` the part that ran while the previous update trained.
"""

from __future__ import annotations

from pathlib import Path

from canntrain_core.jobs.alignment_start import trained
from canntrain_core.recipe import load_recipe
from canntrain_core.train.metrics import read_metrics

# On a CPU a tiny model's engine starts in seconds without compilation; a compiled one takes minutes to save little.
CPU_ENGINE = {"rlhf.rollout.enforce_eager": True, "rlhf.rollout.kv_cache_gib": 1}


ENGINES = {  # name -> the rlhf.rollout keys of that engine's run
    "vllm, staleness 0": {"rlhf.rollout.staleness": 0},
    "vllm, staleness 1": {"rlhf.rollout.staleness": 1},
}
BROADCAST = {"vllm, s1, broadcast": {"rlhf.rollout.staleness": 1, "rlhf.rollout.weight_sync": "broadcast"}}


def rollout_runs(
    recipe_path: str | Path,
    overrides: dict,
    workdir: str | Path,
    name: str,
    engines: dict | None = None,
    engine: dict | None = None,
) -> dict[str, Path]:
    """Run directories of the recipe with the local loop and with vLLM as each of ``engines`` (default
    :data:`ENGINES`) sets it up, each trained once in ``workdir`` (cached as
    :func:`~canntrain_core.jobs.alignment_start.trained` caches); ``engine``: the engine's settings (default
    :data:`CPU_ENGINE`)."""
    runs = {"local": trained(load_recipe(recipe_path, overrides), workdir, name).run_dir}
    for i, (label, keys) in enumerate((engines or ENGINES).items()):
        vllm = {**overrides, "rlhf.rollout.backend": "vllm", **keys, **(engine or CPU_ENGINE)}
        runs[label] = trained(load_recipe(recipe_path, vllm), workdir, f"{name}-vllm{i}").run_dir
    return runs


def _mean(rows: list[dict], key: str) -> float:
    found = [r[key] for r in rows if key in r]
    return sum(found) / len(found) if found else 0.0


def summary(run_dir: str | Path, window: int = 6) -> dict[str, float]:
    """One run's figures: the true score of its first and last ``window`` iterations, and mean seconds per iteration
    spent waiting for samples, scoring, updating and pushing weights, with the generation's own time and overlap."""
    rows = [r for r in read_metrics(run_dir) if "true_score/mean" in r]
    scores = [r["true_score/mean"] for r in rows]
    wait = "timing_s/gen_wait" if any("timing_s/gen_wait" in r for r in rows) else "timing_s/gen"
    parts = {k: _mean(rows, k) for k in (wait, "timing_s/score", "timing_s/update", "timing_s/weight_sync")}
    return {
        "score_first": sum(scores[:window]) / len(scores[:window]),
        "score_last": sum(scores[-window:]) / len(scores[-window:]),
        "s_per_iteration": sum(parts.values()),
        "gen_wait_s": parts[wait],
        "gen_s": _mean(rows, "timing_s/gen"),
        "overlap_s": _mean(rows, "timing_s/gen_overlap"),
        "update_s": parts["timing_s/update"],
        "weight_sync_s": parts["timing_s/weight_sync"],
        "gen_tokens_per_s": _mean(rows, "perf/generation_tokens_per_second"),
        "probs_diff_max": max((r.get("training/rollout_probs_diff_max", 0.0) for r in rows), default=0.0),
    }


def format_comparison(runs: dict[str, Path]) -> str:
    """A table of :func:`summary` per engine."""
    head = (
        f"{'rollouts':20} {'score first->last':>18} {'s/iter':>7} {'gen wait':>9} {'gen':>6} {'overlap':>8} "
        f"{'update':>7} {'w sync':>7} {'gen tok/s':>10} {'max |dp|':>9}"
    )
    lines = [head]
    for name, run in runs.items():
        s = summary(run)
        lines.append(
            f"{name:20} {s['score_first']:8.3f} -> {s['score_last']:.3f} {s['s_per_iteration']:7.2f} "
            f"{s['gen_wait_s']:9.2f} {s['gen_s']:6.2f} {s['overlap_s']:8.2f} {s['update_s']:7.2f} "
            f"{s['weight_sync_s']:7.3f} {s['gen_tokens_per_s']:10,.0f} {s['probs_diff_max']:9.1e}"
        )
    return "\n".join(lines)
