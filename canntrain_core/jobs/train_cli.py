"""`canntrain train RECIPE [--set KEY=VALUE]... [--run-dir DIR] [--resume-from PATH|auto]`."""

from __future__ import annotations

import argparse

from canntrain_core.recipe import load_recipe


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train a recipe without Jupyter")
    p.add_argument("recipe", help="recipe YAML file")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a recipe key, e.g. --set optim.lr=1e-4 (repeatable)",
    )
    p.add_argument("--run-dir", default=None, help="run directory (default: {output_dir}/{name}-{timestamp})")
    p.add_argument(
        "--resume-from",
        default=None,
        metavar="PATH|auto",
        help="checkpoint directory, or 'auto' for the newest complete one in the run directory",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # deferred: start-up time (canntrain --help imports this module; torch only when it trains)
    from torch.distributed.elastic.multiprocessing.errors import record

    # Under torchrun, @record writes a failing rank's exception where the launcher's summary shows it.
    return record(_train)(args)


def _train(args: argparse.Namespace) -> int:
    # Expected failures (bad recipe, data, checkpoint, run directory; out of memory) propagate as
    # CanntrainError: canntrain_core.cli prints them as one line and exits with their code.
    recipe = load_recipe(args.recipe, args.overrides)
    print(recipe.summary())
    # deferred: start-up time (the stages import torch and transformers; a bad recipe is reported before them)
    from canntrain_core.stages import make_trainer

    trainer = make_trainer(recipe, run_dir=args.run_dir, resume_from=args.resume_from, progress=not args.no_progress)
    result = trainer.fit()
    if trainer.rank == 0:
        _draw(trainer.run_dir, trainer.plot)
    print(result)
    return 0


def _draw(run_dir, plot: str) -> None:
    """The stage's picture (``Trainer.plot``) from metrics.jsonl: plots/loss.png, or alignment.png (GRPO, PPO:
    score, reward, KL); a finished run never fails on its picture."""
    try:
        # deferred: start-up time (matplotlib, ~0.4 s, for the plot only; canntrain --help imports this module)
        from canntrain_core.viz.plots import plot_alignment, plot_loss

        if plot == "alignment":
            plot_alignment(run_dir, run_dir / "plots" / "alignment.png")
        else:
            plot_loss([run_dir], run_dir / "plots" / "loss.png")
    except Exception as e:  # matplotlib backends, fonts, a full disk: say so and move on
        print(f"canntrain train: could not draw the plot of {run_dir}: {e}")
