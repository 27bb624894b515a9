"""The training loop: one recipe, one model, one run directory. Read `fit` top to bottom."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from canntrain_core import checkpoint
from canntrain_core.data import build_data
from canntrain_core.models import build_model
from canntrain_core.recipe import Recipe, save_resolved
from canntrain_core.runtime import Accelerator, get_accelerator, seed_everything
from canntrain_core.train.loss import causal_lm_loss, plain_cross_entropy
from canntrain_core.train.metrics import MetricsLog, flops_per_token, peak_flops, read_metrics
from canntrain_core.train.optim import build_optimizer, build_scheduler
from canntrain_core.viz.plots import plot_loss


class RunDirError(RuntimeError):
    """The run directory holds an earlier run that this one would overwrite."""


@dataclass
class RunResult:
    run_dir: Path
    step: int
    loss: float | None
    val_loss: float | None
    checkpoints: list[Path] = field(default_factory=list)

    def __str__(self) -> str:
        val = f"{self.val_loss:.4f}" if self.val_loss is not None else "n/a"
        loss = f"{self.loss:.4f}" if self.loss is not None else "n/a"
        return f"step {self.step}: train loss {loss}, val loss {val} -> {self.run_dir}"


def default_run_dir(recipe: Recipe) -> Path:
    """{output_dir}/{name}-{timestamp}: a fresh directory per run unless one is given."""
    return Path(recipe.experiment.output_dir) / f"{recipe.experiment.name}-{time.strftime('%Y%m%d-%H%M%S')}"


class Trainer:
    """Builds data, model, optimizer and schedule from a recipe and trains them in `fit`.

    ``resume_from``: a checkpoint directory, "auto" (newest complete checkpoint in the run
    directory, or a fresh start when there is none) or None (the recipe's ``resume_from``).
    """

    def __init__(
        self,
        recipe: Recipe,
        run_dir: str | Path | None = None,
        resume_from: str | Path | None = None,
        accelerator: Accelerator | None = None,
        progress: bool = True,
    ):
        self.recipe = recipe
        self.acc = accelerator or get_accelerator()
        self.run_dir = Path(run_dir) if run_dir else default_run_dir(recipe)
        self.ckpt_root = self.run_dir / "checkpoints"
        self.progress = progress
        resume_path = self._resume_path(resume_from if resume_from is not None else recipe.resume_from)

        seed_everything(recipe.experiment.seed)
        self.data = build_data(recipe.data, seed=recipe.experiment.seed)
        m = recipe.model
        self.model = build_model(m.preset, m.overrides, self.data.vocab_size, recipe.experiment.seed, self.acc.device)
        self.cross_entropy = plain_cross_entropy
        self.optimizer = build_optimizer(self.model, recipe.optim)
        self.scheduler = build_scheduler(self.optimizer, recipe.optim)
        # Loss scaling only for fp16; bf16 has fp32's exponent range and needs none.
        self.scaler = torch.amp.GradScaler(self.acc.type, enabled=m.precision == "fp16")
        self.step = 0
        self.metrics = MetricsLog(self.run_dir / "metrics.jsonl")

        self.run_dir.mkdir(parents=True, exist_ok=True)
        if resume_path is not None:
            self._load(resume_path)
        else:
            self.metrics.truncate_after(-1)  # resume_from=auto found nothing: a fresh start
        save_resolved(recipe, self.run_dir)

    # ------------------------------------------------------------------ the loop
    def fit(self, stop_after: int | None = None) -> RunResult:
        """Train to optim.max_steps; ``stop_after=N`` stops early at step N with a checkpoint,
        as a preempted job would, leaving the schedule set for max_steps so a resume continues it."""
        r, acc, model = self.recipe, self.acc, self.model
        accum, max_steps = r.optim.grad_accum_steps, r.optim.max_steps
        tokens_per_step = r.data.batch_size * r.data.seq_length * accum  # this device's share
        flops_step = flops_per_token(model.config, r.data.seq_length) * tokens_per_step
        peak, _ = peak_flops(acc, r.model.precision)
        train_iter = iter(self.data.train_loader())
        val_batches = self.data.val_batches(r.logging.eval_batches)
        if self.step == 0:
            self.metrics.write({"step": 0, **self.evaluate(val_batches)})

        bar = tqdm(total=max_steps, initial=self.step, desc=r.experiment.name, disable=not self.progress)
        acc.reset_peak_memory()
        window_start, window_steps = time.perf_counter(), 0
        while self.step < max_steps:
            model.train()
            lr = self.scheduler.get_last_lr()[0]
            loss_sum = torch.zeros((), device=acc.device)
            for _ in range(accum):
                batch = next(train_iter)
                self.data.sampler.advance(len(batch))
                batch = batch.to(acc.device, non_blocking=True)
                with acc.autocast(r.model.precision):
                    loss = causal_lm_loss(model, batch[:, :-1], batch[:, 1:], self.cross_entropy)
                # Each micro-batch holds the same number of tokens, so the mean of micro-batch
                # means is the mean over the whole accumulated batch.
                self.scaler.scale(loss / accum).backward()
                loss_sum += loss.detach()
            self.scaler.unscale_(self.optimizer)
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), r.optim.grad_clip or math.inf)
            self.scaler.step(self.optimizer)
            self.scaler.update()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.step += 1
            window_steps += 1
            bar.update(1)

            record: dict[str, Any] = {}
            if self.step % r.logging.log_interval == 0 or self.step == max_steps:
                acc.synchronize()
                dt = (time.perf_counter() - window_start) / window_steps
                record = {
                    "loss": (loss_sum / accum).item(),
                    "grad_norm": grad_norm.item(),
                    "lr": lr,
                    "tokens_per_second": tokens_per_step / dt,
                    "tflops": flops_step / dt / 1e12,
                    "mfu": flops_step / dt / peak,
                    "step_time": dt,
                    "peak_memory_bytes": acc.peak_memory_bytes(),
                }
                bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_second']:.0f}")
            if self.step % r.logging.eval_interval == 0 or self.step == max_steps:
                record.update(self.evaluate(val_batches))
            if record:
                self.metrics.write({"step": self.step, **record})
            if self.step % r.logging.ckpt_interval == 0 or self.step in (max_steps, stop_after):
                self.save()
            if self.step == stop_after:
                break
            if record:  # evaluation and checkpoint time is not training throughput
                window_start, window_steps = time.perf_counter(), 0
        bar.close()
        plot_loss([self.run_dir], self.run_dir / "plots" / "loss.png")
        return self.result()

    # ------------------------------------------------------------------ pieces
    @torch.no_grad()
    def evaluate(self, batches: list[torch.Tensor]) -> dict[str, float]:
        self.model.eval()
        total = 0.0
        for batch in batches:
            batch = batch.to(self.acc.device)
            with self.acc.autocast(self.recipe.model.precision):
                total += causal_lm_loss(self.model, batch[:, :-1], batch[:, 1:], self.cross_entropy).item()
        val_loss = total / len(batches)
        return {"val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 50.0))}

    def save(self) -> Path:
        state = {
            "step": self.step,
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "sampler": self.data.sampler.state_dict(),
            "rng": self.acc.rng_state(),
        }
        return checkpoint.save_checkpoint(
            self.ckpt_root, self.step, self.model, self.optimizer, state,
            self.recipe.to_yaml(), keep_last=self.recipe.logging.keep_last,
        )

    def _load(self, path: Path) -> None:
        state = checkpoint.load_checkpoint(path, self.model, self.optimizer)
        self.step = state["step"]
        self.scheduler.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state["scaler"])
        self.data.sampler.load_state_dict(state["sampler"])
        self.acc.set_rng_state(state["rng"])
        self.metrics.truncate_after(self.step)
        print(f"resumed from {path} at step {self.step}")

    def _resume_path(self, resume_from: str | Path | None) -> Path | None:
        existing = checkpoint.list_checkpoints(self.ckpt_root)
        if resume_from is None:
            if existing or (self.run_dir / "metrics.jsonl").is_file():
                what = ", ".join(p.name for p in existing) or "metrics.jsonl"
                raise RunDirError(
                    f"run directory {self.run_dir} already holds an earlier run ({what}). "
                    "Resume it with --resume-from auto (resume_from: auto), or choose a new --run-dir."
                )
            return None
        if str(resume_from) == "auto":
            path = checkpoint.latest_checkpoint(self.ckpt_root)
            if path is None:
                print(f"resume_from=auto: no complete checkpoint in {self.ckpt_root}; starting fresh")
            return path
        path = Path(resume_from)
        checkpoint.verify_checkpoint(path)  # a bad explicit path is an error, not a silent fresh start
        return path

    def result(self) -> RunResult:
        rows = read_metrics(self.run_dir)
        losses = [row["loss"] for row in rows if "loss" in row]
        vals = [row["val_loss"] for row in rows if "val_loss" in row]
        return RunResult(
            run_dir=self.run_dir,
            step=self.step,
            loss=losses[-1] if losses else None,
            val_loss=vals[-1] if vals else None,
            checkpoints=checkpoint.list_checkpoints(self.ckpt_root),
        )
