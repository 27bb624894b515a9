"""A learning-rate sweep for fine-tuning: the same start, data and steps, one run per (mode, lr).

The cann-recipes-train articles disagree: one says raise the fine-tuning learning rate about 10x over pretraining, the
other lower it to about 1e-5. :func:`lr_sweep` runs both (and what lies between) on the tiny
verifiable task and reports held-out loss and exact match, so the answer is measured, not quoted.
"""

from __future__ import annotations

from pathlib import Path

from canntrain_core.recipe import load_recipe
from canntrain_core.train.metrics import read_metrics
from canntrain_core.stages import make_trainer


def lr_sweep(
    recipe_path, overrides: dict, lrs, out: str | Path, modes=("full", "lora"), steps: int = 100
) -> list[dict]:
    """Rows of (mode, lr, final val loss, final exact match, tokens/s); each run in ``out/<mode>-<lr>``."""
    rows = []
    for mode in modes:
        for lr in lrs:
            keys = {
                **overrides,
                "optim.lr": lr,
                "optim.max_steps": steps,
                "logging.eval_interval": steps,
                "logging.log_interval": steps,
                "logging.ckpt_interval": 10**9,
                "lora.enabled": mode == "lora",
            }
            run = Path(out) / f"{mode}-{lr:g}"
            make_trainer(load_recipe(recipe_path, keys), run_dir=run, progress=False).fit()
            last = [r for r in read_metrics(run) if "val_loss" in r][-1]
            speed = [r["tokens_per_second"] for r in read_metrics(run) if "tokens_per_second" in r]
            rows.append(
                {
                    "mode": mode,
                    "lr": lr,
                    "val_loss": last["val_loss"],
                    "exact_match": last.get("val_exact_match"),
                    "tokens_per_second": speed[-1] if speed else None,
                }
            )
    return rows


def format_sweep(rows: list[dict]) -> str:
    lines = [f"{'mode':5} {'lr':>8} {'val loss':>9} {'exact match':>12}"]
    for r in rows:
        em = "" if r["exact_match"] is None else f"{r['exact_match']:.2f}"
        lines.append(f"{r['mode']:5} {r['lr']:8.0e} {r['val_loss']:9.3f} {em:>12}")
    return "\n".join(lines)
