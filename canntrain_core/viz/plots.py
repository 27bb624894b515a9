"""Loss curves from metrics.jsonl, for one run or several overlaid (e.g. a resumed run on its original)."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt

from canntrain_core.errors import BadInput
from canntrain_core.train.metrics import read_metrics


def loss_figure(run_dirs: list[str | Path], labels: list[str] | None = None, styles: list[str] | None = None):
    """A figure with train loss (lines) and validation loss (markers) against step for each run."""
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, run_dir in enumerate(run_dirs):
        rows = read_metrics(run_dir)
        label = labels[i] if labels else Path(run_dir).name
        style = styles[i] if styles else "-"
        train = [(r["step"], r["loss"]) for r in rows if "loss" in r]
        val = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
        if train:
            (line,) = ax.plot(*zip(*train), style, label=f"{label} train")
            color = line.get_color()
        else:
            color = None
        if val:
            ax.plot(*zip(*val), "o", color=color, mfc="none", label=f"{label} val")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return fig


def save_png(fig, out: str | Path) -> Path:
    """Write ``fig`` to the PNG ``out`` (its folder made) and close it."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_loss(run_dirs: list[str | Path], out: str | Path, labels: list[str] | None = None) -> Path:
    """Draw the loss curves of ``run_dirs`` into the PNG ``out``."""
    return save_png(loss_figure(run_dirs, labels), out)


def curves_figure(run_dirs: list[str | Path], keys: list, labels: list[str] | None = None, titles: dict | None = None):
    """One panel per metric in ``keys`` (against step), one line per run; a run without a metric is left out
    of its panel. A key may be a tuple of keys: each run plots the first of them it logged (GRPO's
    ``actor/kl_loss`` and PPO's ``actor/reward_kl_penalty`` in one panel). For alignment runs (verl's names,
    docs/alignment.md): ``true_score/mean`` (the checker's score), ``critic/score/mean`` (the score the
    policy is trained on), ``actor/kl_loss`` or ``actor/reward_kl_penalty``, ``val_score``."""
    fig, axes = plt.subplots(1, len(keys), figsize=(4.2 * len(keys), 3.4), squeeze=False)
    runs = [read_metrics(run_dir) for run_dir in run_dirs]
    for ax, key in zip(axes[0], keys):
        for i, (run_dir, rows) in enumerate(zip(run_dirs, runs)):
            found = next((k for k in (key if isinstance(key, tuple) else (key,)) if any(k in r for r in rows)), None)
            points = [(r["step"], r[found]) for r in rows if found in r]
            if points:
                ax.plot(
                    *zip(*points),
                    "o-" if len(points) < 6 else "-",
                    ms=4,
                    label=labels[i] if labels else Path(run_dir).name,
                )
        ax.set_title((titles or {}).get(key, " or ".join(key) if isinstance(key, tuple) else key))
        ax.set_xlabel("step")  # an alignment run's iteration is its step
        ax.grid(alpha=0.3)
    axes[0][0].legend()
    fig.tight_layout()
    return fig


KL_KEYS = ("actor/kl_loss", "actor/reward_kl_penalty")  # GRPO's KL in the loss, PPO's KL in the reward


def plot_alignment(run_dir: str | Path, out: str | Path) -> Path:
    """An online alignment run's true score, the score it was trained on (when it differs: a reward model,
    a missing-end penalty), its KL to the reference (when it has one) and the held-out score, into ``out``."""
    rows = read_metrics(run_dir)
    trained_on = any(r.get("critic/score/mean") != r.get("true_score/mean") for r in rows if "critic/score/mean" in r)
    kl = [k for k in KL_KEYS if any(k in r for r in rows)]
    keys = ["true_score/mean"] + ["critic/score/mean"] * trained_on + kl[:1] + ["val_score"]
    return save_png(curves_figure([run_dir], keys), out)


def expert_balance_figure(run_dir: str | Path):
    """A mixture of experts' routing from metrics.jsonl: the busiest and the idlest expert against the mean over
    training (1 is even routing), and the last logged interval's share of each layer's tokens per expert."""
    rows = [r for r in read_metrics(run_dir) if "expert_tokens" in r]
    if not rows:
        raise ValueError(f"{run_dir}: metrics.jsonl has no expert_tokens (not a mixture of experts' run)")
    fig, (ax, heat) = plt.subplots(1, 2, figsize=(10, 3.4), gridspec_kw={"width_ratios": [1.3, 1]})
    steps = [r["step"] for r in rows]
    for key, label in (("expert_tokens_max", "busiest expert"), ("expert_tokens_min", "idlest expert")):
        ax.plot(steps, [r[key] / r["expert_tokens_mean"] for r in rows], "o-" if len(rows) < 6 else "-", label=label)
    ax.axhline(1.0, color="k", lw=0.8, ls="--")
    ax.set_xlabel("step")
    ax.set_ylabel("tokens / mean tokens per expert")
    ax.grid(alpha=0.3)
    ax.legend()
    last = rows[-1]["expert_tokens"]
    share = [[n / max(sum(layer), 1) for n in layer] for layer in last]
    im = heat.imshow(share, aspect="auto", cmap="viridis")
    heat.set_xticks(range(len(share[0])))  # whole experts and layers, never 0.5 of one
    heat.set_yticks(range(len(share)))
    heat.set_xlabel("expert")
    heat.set_ylabel("layer")
    heat.set_title(f"share of a layer's tokens, step {rows[-1]['step']}")
    fig.colorbar(im, ax=heat)
    fig.tight_layout()
    return fig


def plot_curves(
    run_dirs: list[str | Path], keys: list[str], out: str | Path, labels: list[str] | None = None
) -> tuple[Path, dict[str, int]]:
    """``curves_figure`` of the ``keys`` any of ``run_dirs`` logged, saved as the PNG ``out``; returns it and the
    number of runs drawn per key. A directory without metrics.jsonl, labels that do not match the runs, or no
    key logged by any run is a BadInput naming it."""
    for run_dir in run_dirs:
        if not (Path(run_dir) / "metrics.jsonl").is_file():
            raise BadInput(f"{run_dir}: no metrics.jsonl (not a run directory)")
    if labels is not None and len(labels) != len(run_dirs):
        raise BadInput(f"--labels: {len(labels)} labels for {len(run_dirs)} runs")
    rows = [read_metrics(run_dir) for run_dir in run_dirs]
    drawn = {key: sum(any(key in r for r in run) for run in rows) for key in keys}
    found = [key for key, n in drawn.items() if n]
    if not found:
        logged = sorted({k for run in rows for r in run for k in r if isinstance(r[k], (int, float))} - {"step"})
        raise BadInput(f"--keys: no run logged {', '.join(keys)}; they log {', '.join(logged)}")
    return save_png(curves_figure(run_dirs, found, labels), out), {key: drawn[key] for key in found}


def source_tokens_figure(run_dir: str | Path, weights: dict[str, float] | None = None):
    """A mixture's training tokens drawn from each source against step (``tokens/<name>`` in metrics.jsonl), and
    each source's share of them; ``weights`` (name -> weight) draws the intended shares as dashed lines."""
    rows = [r for r in read_metrics(run_dir) if any(k.startswith("tokens/") for k in r)]
    if not rows:
        raise BadInput(f"{run_dir}: metrics.jsonl has no tokens/<source> rows (a run on one source logs none)")
    names = [k.removeprefix("tokens/") for k in rows[-1] if k.startswith("tokens/")]
    steps = [r["step"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    total = [sum(r[f"tokens/{n}"] for n in names) for r in rows]
    for n in names:
        tokens = [r[f"tokens/{n}"] for r in rows]
        (line,) = left.plot(steps, tokens, label=n)
        right.plot(steps, [t / max(s, 1) for t, s in zip(tokens, total)], color=line.get_color(), label=n)
        if weights and n in weights:
            right.axhline(weights[n] / sum(weights.values()), color=line.get_color(), ls="--", lw=1)
    left.set(xlabel="step", ylabel="training tokens drawn", title="tokens per source")
    right.set(xlabel="step", ylabel="share of tokens", title="share (dashed: the weights)", ylim=(0, 1))
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    return fig
