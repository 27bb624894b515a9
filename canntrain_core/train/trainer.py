"""The training loop: one recipe, one model, one run directory. Read `fit` top to bottom.

The same loop runs single-process and under torchrun: the recipe's `distributed` section picks the
mesh (pp, dp_replicate, dp_shard, cp, tp), `parallelize` applies it, and only rank 0 writes metrics.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
from datetime import timedelta
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist

from canntrain_core import checkpoint
from canntrain_core.checkpoint.drift import check_resume
from canntrain_core.checkpoint.export import BASE_FINGERPRINT, STAGE_FILE, check_base
from canntrain_core.data import build_data, pretrained_tokenizer
from canntrain_core.data.pipeline import drawn_per_source, epochs_summary, model_vocab_size
from canntrain_core.data.tokenizer import tokenizer_files
from canntrain_core.finetune.data import real_tokens
from canntrain_core.finetune.evaluate import exact_match
from canntrain_core.errors import BadInput, CollectiveFailed, OutOfMemory, RecipeError
from canntrain_core.models.fused import check_kernels_fit
from canntrain_core.models.hf import base_fingerprint
from canntrain_core.models.lifecycle import build_training_model
from canntrain_core.models.lora import adapter_summary, has_adapters, trainable_summary
from canntrain_core.models.registry import model_config
from canntrain_core.parallel.clip import clip_grad_norm
from canntrain_core.parallel.data_parallel import sync_gradients
from canntrain_core.recipe import Recipe, save_resolved
from canntrain_core.runtime import Accelerator, get_accelerator, seed_everything
from canntrain_core.runtime.distributed import (
    ParallelDims,
    dp_coordinates,
    from_rank0,
    init_distributed,
    rank,
)
from canntrain_core.runtime.log import get_logger
from canntrain_core.train.callbacks import Throughput, engine_callbacks
from canntrain_core.runtime.environment import check_ranks_agree, check_target_device
from canntrain_core.runtime.watchdog import Whereabouts, describe_failure, is_collective_failure
from canntrain_core.sizing.layout import check_layout
from canntrain_core.sizing.oom import oom_hint
from canntrain_core.train.metrics import MetricsLog, flops_per_token, peak_flops, read_metrics
from canntrain_core.train.trackers import tracker_sinks
from canntrain_core.train.optim import build_optimizer, build_scheduler
from canntrain_core.train.health import Health, checkpoint_sentence


log = get_logger(__name__)


class RunDirError(BadInput):
    """The run directory holds an earlier run that this one would overwrite, or cannot be written."""


def check_run_dir(run_dir: Path) -> None:
    """Refuse, before any work, a run directory that cannot be made or written: it is a file, a parent of it is a
    file, or the nearest existing directory is not writable (a read-only file system, permissions)."""
    existing = run_dir
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if existing == run_dir and not run_dir.is_dir():
        raise RunDirError(f"run directory {run_dir} is a file, not a directory; choose another --run-dir")
    if not existing.is_dir():
        raise RunDirError(f"run directory {run_dir}: {existing} is a file, so no directory can be made under it")
    if not os.access(existing, os.W_OK | os.X_OK):
        why = "a read-only file system" if _read_only(existing) else "no write permission"
        raise RunDirError(f"run directory {run_dir}: {existing} cannot be written ({why}); choose another --run-dir")


def _read_only(path: Path) -> bool:
    return bool(os.statvfs(path).f_flag & os.ST_RDONLY)


def _is_oom(e: BaseException) -> bool:
    # CUDA raises torch.OutOfMemoryError; torch_npu a RuntimeError saying "NPU out of memory"; the CPU allocator
    # "can't allocate memory" (and Python a MemoryError) past a data size limit (distributed.memory_budget_gb).
    text = str(e).lower()
    return isinstance(e, (torch.OutOfMemoryError, MemoryError)) or "out of memory" in text or "allocate memory" in text


@dataclass
class RunResult:
    run_dir: Path
    step: int
    loss: float | None
    val_loss: float | None
    checkpoints: list[Path] = field(default_factory=list)
    score: float | None = None  # GRPO, PPO: the last iteration's true score of the samples
    val_score: float | None = None  # and the last held-out greedy score

    def __str__(self) -> str:
        if self.score is not None:
            val = f"{self.val_score:.4f}" if self.val_score is not None else "n/a"
            return f"step {self.step}: true score of the samples {self.score:.4f}, held-out {val} -> {self.run_dir}"
        val = f"{self.val_loss:.4f}" if self.val_loss is not None else "n/a"
        loss = f"{self.loss:.4f}" if self.loss is not None else "n/a"
        return f"step {self.step}: train loss {loss}, val loss {val} -> {self.run_dir}"


RUNS_ENV = "CANNTRAIN_RUNS"


def runs_root(default: str | Path = "runs") -> Path:
    """Where runs go that are given no directory: ``$CANNTRAIN_RUNS`` when set (the test suite points it at
    a temporary directory, so nothing trains into the checkout), else ``default``."""
    return Path(os.environ.get(RUNS_ENV) or default)


def default_run_dir(recipe: Recipe) -> Path:
    """{output_dir}/{name}-{timestamp} (``output_dir``: ``$CANNTRAIN_RUNS`` when set): a fresh directory per
    run unless one is given."""
    return runs_root(recipe.experiment.output_dir) / f"{recipe.experiment.name}-{time.strftime('%Y%m%d-%H%M%S')}"


def _added(total: torch.Tensor | None, x: torch.Tensor | None) -> torch.Tensor | None:
    """``total + x``, where None is nothing yet (or nothing to count)."""
    if x is None:
        return total
    return x.clone() if total is None else total + x


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
        callbacks: list | None = None,
    ):
        if recipe.train_mode not in self.train_modes:  # a stage's recipe never runs another stage's loop
            raise RecipeError(
                f"train_mode {recipe.train_mode}: {type(self).__name__} trains "
                f"{', '.join(self.train_modes)}; build a recipe's trainer with "
                "canntrain_core.stages.make_trainer"
            )
        self.recipe = r = recipe.model_copy(
            deep=True
        )  # the caller's recipe is not changed (optim.epochs sets max_steps)
        self.acc = accelerator or get_accelerator()
        self.callbacks = list(callbacks or [])  # a user's (train/callbacks.py), after the engine's own
        m, d = r.model, r.distributed
        if not m.init_from:  # the embedding rows the data implies: written into the resolved recipe
            r.data.tokenizer.vocab_size = model_vocab_size(r.data)
        self.model_config = config = model_config(m, r.data.tokenizer.vocab_size)
        check_layout(r, config, int(os.environ.get("LOCAL_WORLD_SIZE", "0")) or None)
        check_kernels_fit(config, m)
        check_target_device(d.target_device, self.acc.type)
        init_distributed(self.acc, d, self.extra_ranks(r))
        check_ranks_agree(self.acc.type, timedelta(seconds=d.timeout_seconds))
        self.rank = rank()
        self.where = Whereabouts()  # this rank's step and phase, for a collective that never finishes
        self.dims = ParallelDims.from_recipe(r)
        self.mesh = self.dims.build_mesh(self.acc.type)
        self.run_dir = Path(from_rank0(str(run_dir or default_run_dir(r))))
        self.ckpt_root = self.run_dir / "checkpoints"
        self.progress = progress and self.rank == 0
        # Rank 0 inspects the run directory (and hashes the checkpoint once); every rank gets its
        # answer, and no rank goes on before it has one, so nothing is written before the check.
        resume_path = self._on_rank0(
            lambda: self._inspect_run_dir(resume_from if resume_from is not None else r.resume_from)
        )

        seed_everything(r.experiment.seed)
        self.dp = dp_coordinates(self.mesh, self.dims)  # (data-parallel rank, size)
        self.data = self.build_data(config)
        if r.optim.epochs:  # max_steps from the data: epochs x this rank's rows / rows per step
            steps = math.ceil(
                r.optim.epochs * self.data.sampler.samples_per_epoch / (r.data.batch_size * r.optim.grad_accum_steps)
            )
            log.info(
                f"optim.epochs={r.optim.epochs:g}: {steps} steps ({self.data.sampler.samples_per_epoch} rows "
                f"per data-parallel rank per epoch)"
            )
            r.optim.max_steps = steps
        if hasattr(self.data, "names"):  # each source's share and passes (data.max_source_epochs refuses too many)
            line = epochs_summary(self.data, r.optim.max_steps * r.global_batch_size)
            if len(self.data.names) > 1:
                log.info(line)
        if not m.init_from:  # the trained tokenizer's EOS, for generate() and an exported model
            config.bos_token_id, config.eos_token_id = None, self.data.eos_id
        self.memory_baseline = self.acc.memory_in_use()  # distributed.memory_budget_gb counts from here
        self.undo_budget = None
        built = self.build_model(config, fill=resume_path is None)
        self.model, self.schedule = built.model, built.schedule
        for name, value in built.held.items():  # the stage's other models and their state (its build returned them)
            setattr(self, name, value)
        self.aux_loss: torch.Tensor | None = None  # a mixture of experts' load-balancing loss over the last step
        self.expert_tokens: torch.Tensor | None = None  # and its routed tokens per layer and expert since the last log
        self.dropped_tokens: torch.Tensor | None = None  # and per layer those over capacity (expert_capacity_factor)
        self.health = Health(r, self.rank, self.acc.synchronize)  # NaN/inf and spikes, the step's time breakdown
        self.throughput = Throughput()  # the logging interval's clock (a callback of the loop)
        self.timer = self.health.timer  # where a step's time goes (every stage times its phases with it)
        self.real_tokens = 0  # instruction rows: this rank's input tokens that were not padding, since the last log
        # an adapted model (LoRA) checkpoints its adapters only; they name the base they adapt
        self.adapters_only = has_adapters(self.model)
        if resume_path is not None and self.adapters_only:
            self._on_rank0(lambda: check_base(resume_path, m.init_from, "resume", self.lora_base_fingerprint))
        self.loaded_from = built.loaded  # init_from: this rank's tensors and the slices it read
        if r.optim.offload_optimizer and self.acc.type == "cpu":
            log.info(
                "optim.offload_optimizer: FSDP2's CPUOffloadPolicy is applied, but on this CPU-only host "
                "parameters, gradients and optimizer states are in host memory already: a no-op here"
            )
        if self.adapters_only:
            log.info(f"LoRA {adapter_summary(self.model)}: {trainable_summary(self.model)}")
        if m.init_from and resume_path is None:
            log.info(
                f"model: {built.source} (the architecture from its config.json); tokenizer: "
                f"{self.data.info['tokenizer_path']} (data.tokenizer's training settings do not apply)"
                + (f"; chat template: {self.data.info['chat_template']}" if "chat_template" in self.data.info else "")
            )
        self.pp_group = self.mesh["pp"].get_group() if self.dims.pp > 1 else None
        self.microbatches = r.layout.microbatches  # what the pipeline schedule splits a step into
        self.has_loss = self.dims.pp == 1 or self.mesh.get_local_rank("pp") == self.dims.pp - 1
        self.optimizer = build_optimizer(self.model, r.optim)
        self.scheduler = build_scheduler(self.optimizer, r.optim)
        # Loss scaling only for fp16; bf16 has fp32's exponent range and needs none.
        self.scaler = torch.amp.GradScaler(self.acc.type, enabled=m.precision == "fp16")
        self.step = 0
        self.metrics = MetricsLog(
            self.run_dir / "metrics.jsonl", tracker_sinks(r, self.run_dir) if self.rank == 0 else []
        )
        self.harness_tasks = self._harness_tasks() if r.logging.eval_tasks else None

        if self.rank == 0:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        if resume_path is not None:
            self._load(resume_path)
        elif self.rank == 0:
            self.metrics.truncate_after(-1)  # resume_from=auto found nothing: a fresh start
        if self.loaded_from:  # each rank: which slice of which file it read
            where = self.run_dir / "init_from"
            where.mkdir(parents=True, exist_ok=True)
            (where / f"rank{self.rank}.json").write_text(json.dumps(self.loaded_from, indent=0))
        if self.rank == 0:
            save_resolved(r, self.run_dir)
            (self.run_dir / "data.json").write_text(json.dumps(self.data.info, indent=1))
            # (the stdlib's deliberately non-UTF-8 test files are counted there too, not printed)
            if self.data.info.get("bad_records") and r.data.source != "stdlib":
                log.info(
                    f"data: skipped {self.data.info['bad_records']} bad record(s) "
                    f"(data.on_bad_record={r.data.on_bad_record}); see {self.run_dir / 'data.json'}"
                )

    def _on_rank0(self, work):
        """``work()`` on rank 0, its answer on every rank; a BadInput it raises is raised on every rank
        (none waits for the others forever)."""
        found = None
        if self.rank == 0:
            try:
                found = work()
            except BadInput as e:
                found = e
        found = from_rank0(found)
        if isinstance(found, Exception):
            raise found
        return found

    # ------------------------------------------------------------------ what a stage builds
    @staticmethod
    def extra_ranks(recipe: Recipe) -> int:
        """Processes of the job beyond the trained model's layout (PPO's separated frozen models)."""
        return 0

    def models(self) -> dict:
        """The models this stage holds, by role (the alignment stages add their frozen ones): what the memory
        tools measure."""
        return {"model": self.model}

    @staticmethod
    def roles(recipe: Recipe) -> list[tuple[str, bool, bool]]:
        """(name as :meth:`models` gives it, trains, scalar head) of each model a rank of ``recipe`` holds:
        what ``memory.alignment`` estimates, before anything is built."""
        return [("model", True, False)]

    @staticmethod
    def rows(recipe: Recipe) -> tuple[int, int]:
        """(rows of one optimizer update, rows one rollout samples) per rank: the memory estimate's batch."""
        return recipe.data.batch_size, 0

    def extra_state(self) -> dict:
        """What a stage adds to each checkpoint's trainer state (PPO: its adaptive KL coefficient)."""
        return {}

    def load_extra_state(self, state: dict) -> None:
        pass

    # What a stage says about itself (the engine asks these, never the stage's name):
    train_modes: tuple[str, ...] = ("pretrain",)  # the recipes it trains (canntrain_core/stages/ maps each to one)
    language_model = ""  # where the language model sits in this stage's model state (PPO: its "actor.")
    not_a_language_model: str | None = None  # why export and generate refuse this stage's checkpoints
    formats_conversations = False  # its records are conversations: the chat template applies
    plot = "loss"  # the picture ``canntrain train`` draws of a run: plots/loss.png, or alignment.png
    token_weighted = False  # its rows train unequal numbers of tokens: losses are means over trained tokens

    def build_data(self, config):
        """The data bundle of this stage: pretraining text here; the other stages override it."""
        r = self.recipe
        return build_data(
            r.data,
            seed=r.experiment.seed,
            dp_rank=self.dp[0],
            dp_size=self.dp[1],
            model_type=config.model_type,
            **self.tokenizer_args(config),
        )

    def tokenizer_args(self, config) -> dict:
        """``model.init_from``'s tokenizer, the model's vocabulary size and, for a stage that formats
        conversations (``formats_conversations``), the chat template ``data.chat_template`` picks: every stage's
        data builder takes its tokenizer from here (``data.tokenizer.pretrained_tokenizer``)."""
        r = self.recipe
        chat = r.data.chat_template if self.formats_conversations else None
        args = pretrained_tokenizer(r.model.init_from, config, chat, r.data.tokenizer.path)
        self._given_tokenizer = args.get("tokenizer")  # its special tokens go into every checkpoint
        return args

    def build_model(self, config, fill: bool):
        """The model this stage trains (a CausalLM; the alignment stages add the ones they only run)."""
        return build_training_model(self.recipe, config, self.acc.device, self.mesh, self.dims, fill=fill)

    # ------------------------------------------------------------------ the loop
    def fit(self, stop_after: int | None = None) -> RunResult:
        """Train to optim.max_steps; ``stop_after=N`` stops early at step N with a checkpoint,
        as a preempted job would, leaving the schedule set for max_steps so a resume continues it.

        The one loop of every stage: each step the stage trains on its next batch (``train_iteration``: forward,
        backward and its optimizer step(s)), the schedule steps, and the cadence of ``logging`` decides what is
        logged (``log_record``), evaluated, checkpointed."""
        r = self.recipe
        batches = self.batches()
        if self.step == 0:
            self._write({"step": 0, **self.evaluate()})
        callbacks = engine_callbacks(self) + self.callbacks
        self.acc.reset_peak_memory()
        try:
            for cb in callbacks:
                cb.on_fit_start(self)
            while self.step < r.optim.max_steps:
                for cb in callbacks:
                    cb.before_step(self, self.step + 1)
                self.where.post(self.step + 1, "data")
                with self.timer("data"):
                    batch = next(batches)
                self.where.post(self.step + 1, "compute")
                try:  # every stage's step; the optimizer's first allocates its states
                    raw = self.train_iteration(batch)
                except (RuntimeError, MemoryError) as e:  # torch.OutOfMemoryError is a RuntimeError
                    if not _is_oom(e):
                        raise
                    raise self._out_of_memory(e) from e
                for cb in callbacks:
                    cb.after_iteration(self, self.step + 1)
                self.scheduler.step()
                self.step += 1
                last = self.step == r.optim.max_steps
                record = self.log_record(raw, last)
                if self.step % r.logging.eval_interval == 0 or last:
                    self.where.post(self.step, "evaluate")
                    with self.paused():
                        record = self.with_evaluation(record, raw)
                for cb in callbacks:
                    cb.after_step(self, raw, record)
                if record:
                    self._write({"step": self.step, **record})
                if self.step % r.logging.ckpt_interval == 0 or self.step in (r.optim.max_steps, stop_after):
                    self.where.post(self.step, "checkpoint")
                    with self.paused():
                        started = time.perf_counter()
                        self.save()
                        self.health.checkpoint_seconds = time.perf_counter() - started
                if self.step == stop_after:
                    break
        except BaseException as e:  # a save's collectives fail inside torch's CheckpointException, a BaseException
            if not is_collective_failure(e):
                raise
            raise CollectiveFailed(
                f"{describe_failure(e, self.where, r.distributed.timeout_seconds)}. "
                + checkpoint_sentence(self._last_checkpoint())
            ) from e
        finally:
            for cb in reversed(callbacks):
                cb.on_fit_end(self)
            self.metrics.close()  # its sinks: TensorBoard's writer, a notebook's last held-back picture
            self.close()
        return self.result()  # plots are drawn from metrics.jsonl by the CLI and the notebooks

    def paused(self) -> contextlib.AbstractContextManager:
        """Evaluation and checkpoints are not training throughput: their time is taken off the interval's clock."""
        return self.throughput.paused()

    # ------------------------------------------------------------------ a stage's step (pretraining's here)
    def batches(self) -> Iterator:
        """What each step trains on, in order: here one step's micro-batches (the sampler advanced by them)."""
        r = self.recipe
        train_iter = iter(self.data.train_loader())  # now, before the first evaluation, as it always was

        def steps():
            while True:
                micro_batches = []
                for _ in range(r.optim.grad_accum_steps):
                    micro_batches.append(next(train_iter))
                    self.data.sampler.advance(r.data.batch_size)
                yield micro_batches

        return steps()

    def train_iteration(self, micro_batches: list) -> dict:
        """One optimizer step on ``micro_batches``; what :meth:`log_record` reads of it."""
        lr = self.scheduler.get_last_lr()[0]
        self.model.train()
        loss = self.train_step(micro_batches)
        return {"loss": loss, "grad_norm": self.optimizer_step(), "lr": lr}

    def optimizer_step(self) -> torch.Tensor:
        """Unscale (fp16), clip and step, the optimizer of every stage; returns the gradient norm (over all ranks).
        A NaN or inf norm stops the run naming the last complete checkpoint, or skips the update
        (``optim.nonfinite``); one far above the recent ones is reported (``logging.grad_spike_factor``)."""
        with self.timer("optimizer"):
            self.scaler.unscale_(self.optimizer)
            grad_norm = clip_grad_norm(self.model.parameters(), self.recipe.optim.grad_clip, self.pp_group)
            norm = float(grad_norm)  # the same on every rank: the decision below is too
            fp16_skips = self.scaler.is_enabled() and not math.isfinite(norm)  # fp16's scaler skips it itself
            if fp16_skips or self.health.allows(norm, self.step + 1, self._last_checkpoint):
                self.scaler.step(self.optimizer)
                self.scaler.update()
            self.optimizer.zero_grad(set_to_none=True)
        return grad_norm

    def _last_checkpoint(self) -> Path | None:
        """The newest complete checkpoint, named when a run stops (NaN, a hung collective, out of memory); not
        hashed: on a 70B model that would read the whole checkpoint on every rank in a failure path."""
        done = checkpoint.complete_checkpoints(self.ckpt_root)
        return done[-1] if done else None

    def log_record(self, raw: dict, last: bool) -> dict[str, Any]:
        """What this step logs ({} between ``logging.log_interval``s): loss over data-parallel ranks, gradient
        norm, learning rate, and throughput over the steps since the last logged row."""
        r, acc = self.recipe, self.acc
        if not (self.step % r.logging.log_interval == 0 or last):
            return {}
        acc.synchronize()
        steps, dt = self.throughput.take()
        # Tokens this device trains on per step: its data-parallel share, split over tp/pp/cp.
        tokens = r.data.batch_size * r.data.seq_length * r.optim.grad_accum_steps / self.dims.non_data_parallel
        flops = flops_per_token(self.model_config, r.data.seq_length) * tokens
        record = {
            "loss": self._mean_over_ranks(raw["loss"]),
            "grad_norm": raw["grad_norm"].item(),
            "lr": raw["lr"],
            "tokens_per_second": tokens / dt,
            "tflops": flops / dt / 1e12,
            "mfu": flops / dt / peak_flops(acc, r.model.precision)[0],
            "step_time": dt,
            "peak_memory_bytes": acc.peak_memory_bytes(),
        }
        if self.aux_loss is not None:  # MoE: "loss" holds router_aux_loss_coef x it, as transformers' loss does
            record["aux_loss"] = self._mean_over_ranks(self.aux_loss)
            record.update(self._expert_balance())
        record.update(self.health.take(steps, dt))
        if len(getattr(self.data, "names", ())) > 1:  # a mixture: what was drawn from each source so far
            record.update(drawn_per_source(self.data))
        if "padding_fraction" in self.data.info:  # instruction rows: the interval's tokens that were not padding
            real = (
                self._sum_over_dp(torch.tensor(float(self.real_tokens), device=self.acc.device), everywhere=True)
                / self.dims.dp
            )
            record["real_tokens_per_second"] = real / self.dims.non_data_parallel / (dt * steps)
            self.real_tokens = 0
        return record

    def with_evaluation(self, record: dict, raw: dict) -> dict:
        """``record`` with this step's evaluation (``logging.eval_interval``)."""
        return {**record, **self.evaluate()}

    def postfix(self, raw: dict, record: dict) -> dict | None:
        """The progress bar's figures after a step (None: unchanged)."""
        if "tokens_per_second" not in record:
            return None
        return {"loss": f"{record['loss']:.3f}", "tok_s": f"{record['tokens_per_second']:.0f}"}

    def close(self) -> None:
        """What a stage releases when its loop ends, finished or not (PPO: its scorer ranks)."""

    def train_step(self, micro_batches: list) -> torch.Tensor:
        """Forward and backward over one optimizer step's micro-batches; returns the step's loss
        (zero on pipeline stages without the head)."""
        acc, precision = self.acc, self.recipe.model.precision
        parts = [self._model_args(b) for b in micro_batches]
        self.real_tokens += sum(real_tokens(b) for b in micro_batches if isinstance(b, dict))
        weights = self._token_weights([t for _, t, _ in parts])
        if self.schedule is not None:
            x, t = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])  # the schedule re-splits
            self.model.token_weight = None if weights is None else self._pp_token_weight
            with self.timer("forward_backward"), acc.autocast(precision):
                return self._pipeline(self.schedule.step, x, t)
        loss_sum = torch.zeros((), device=acc.device)
        self.aux_loss = None if self.model.routers is None else torch.zeros((), device=acc.device)
        for i, (x, t, kw) in enumerate(parts):
            sync_gradients(self.model, self.recipe.distributed.zero_optimization, last=i == len(parts) - 1)
            with self.timer("forward"), acc.autocast(precision):
                loss = self.model(x, t, **kw)
            # Pretraining rows hold the same number of tokens: the mean of micro-batch means is the
            # step's mean. Instruction rows do not: each loss is weighted by its share of the step's
            # trained tokens over all data-parallel ranks (x dp: the gradient reduction averages).
            part = loss / len(parts) if weights is None else loss * weights[i]
            with self.timer("backward"):
                self.scaler.scale(part).backward()
            loss_sum += part.detach()
            if self.aux_loss is not None:  # a mixture of experts: its load-balancing loss, logged apart
                self.aux_loss += self.model.aux_loss / len(parts)
                self.expert_tokens = _added(self.expert_tokens, self.model.expert_tokens)
                self.dropped_tokens = _added(self.dropped_tokens, self.model.dropped_tokens)
        return loss_sum

    def _model_args(self, batch) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """(inputs, targets, extra model arguments) of one micro-batch, on the device; under context parallel
        this rank's slices of them (``ContextParallel.split_batch``)."""
        dev = self.acc.device
        if isinstance(batch, dict):  # instruction rows: labels -100 where nothing is trained
            b = {k: v.to(dev, non_blocking=True) for k, v in batch.items()}
            x, t = b["input_ids"][:, :-1], b["labels"][:, 1:]
            extra = {"position_ids": b["position_ids"][:, :-1]}
            if "segment_ids" in b:
                extra["segment_ids"] = b["segment_ids"][:, :-1]
        else:
            batch = batch.to(dev, non_blocking=True)
            x, t, extra = batch[:, :-1], batch[:, 1:], {}
        cp = self.model.context_parallel
        if cp is None:
            return x, t, extra
        x, t, pos, segs = cp.split_batch(x, t, extra.get("position_ids"), extra.get("segment_ids"))
        return (
            x,
            t,
            {"position_ids": pos, "context_parallel": True, **({"segment_ids": segs} if segs is not None else {})},
        )

    def _token_weights(self, targets: list[torch.Tensor]) -> list[float] | None:
        """``token_weighted`` rows: each micro-batch's weight = its trained tokens / the step's, times dp."""
        if not self.token_weighted:
            return None
        counts = [int((t != -100).sum()) for t in targets]
        # cp ranks hold parts of the rows, not copies; the gradient is averaged over the dp x cp ranks
        total = self._sum_over_dp(torch.tensor(float(sum(counts)), device=self.acc.device), everywhere=True)
        total *= self.dims.cp
        ranks = self.dims.dp * self.dims.cp
        n_micro = self.microbatches if self.schedule is not None else len(targets)
        self._pp_token_weight = n_micro * ranks / total  # the schedule averages its micro-batch losses
        return [c * ranks / total for c in counts]

    def _sum_over_dp(self, value: torch.Tensor, everywhere: bool = False) -> float:
        """The sum over data-parallel ranks of a value every tp/cp rank holds a copy of (the last pipeline
        stage only, unless ``everywhere``)."""
        if not dist.is_initialized():
            return value.item()
        mine = value if (self.has_loss or everywhere) else torch.zeros_like(value)
        total = mine.detach().float().clone()
        dist.all_reduce(total)
        copies = self.dims.tp * self.dims.cp * (self.dims.pp if everywhere else 1)
        return (total / copies).item()

    def _pipeline(self, run, x: torch.Tensor, t: torch.Tensor | None = None) -> torch.Tensor:
        """One schedule.step / schedule.eval: the first stage feeds inputs, the last gets targets."""
        stage = self.mesh.get_local_rank("pp")
        first, last = stage == 0, stage == self.dims.pp - 1
        losses: list[torch.Tensor] = []
        args = (x,) if first else ()
        kwargs = {"target": t, "losses": losses} if last else {}
        run(*args, **kwargs)
        return torch.stack(losses).mean().detach() if last else torch.zeros((), device=self.acc.device)

    def limit_memory(self) -> None:
        budget = self.recipe.distributed.memory_budget_gb
        if budget and self.undo_budget is None:
            self.undo_budget = self.acc.limit_memory(int(budget * 2**30), since=self.memory_baseline)

    def release_memory(self) -> None:
        if self.undo_budget is not None:
            self.undo_budget()
            self.undo_budget = None

    def _out_of_memory(self, error: BaseException) -> OutOfMemory:
        self.release_memory()  # the diagnosis needs a little memory itself
        budget = self.recipe.distributed.memory_budget_gb
        capacity = budget * 2**30 if budget else self.acc.memory_capacity_bytes() or 0
        hint = oom_hint(self.recipe, capacity, self.model_config)
        return OutOfMemory(f"step {self.step + 1}: {error}\n{hint}\n{checkpoint_sentence(self._last_checkpoint())}")

    def _expert_balance(self) -> dict[str, Any]:
        """Routed tokens per layer and expert since the last log, over all ranks (``expert_tokens``: a list per
        layer), and their min / mean / max; resets the count. Even routing gives min == mean == max."""
        counts, self.expert_tokens = self.expert_tokens, None
        dropped, self.dropped_tokens = self.dropped_tokens, None
        if dist.is_initialized():  # each data-parallel rank routes its own tokens; tp/cp ranks hold copies
            copies = self.dims.tp * self.dims.cp
            dist.all_reduce(counts)
            counts //= copies
            if dropped is not None:
                dist.all_reduce(dropped)
                dropped //= copies
        c = counts.float()
        record = {
            "expert_tokens": counts.tolist(),
            "expert_tokens_min": c.min().item(),
            "expert_tokens_mean": c.mean().item(),
            "expert_tokens_max": c.max().item(),
        }
        if dropped is not None:  # expert_capacity_factor: assignments the experts left out, and their share
            record["dropped_tokens"] = int(dropped.sum())
            record["dropped_fraction"] = record["dropped_tokens"] / int(counts.sum())
        return record

    def _mean_over_ranks(self, loss: torch.Tensor) -> float:
        """The loss averaged over data-parallel ranks (tp ranks hold copies; only the last pp stage has one)."""
        return self._sum_over_dp(loss) / self.dims.dp

    # ------------------------------------------------------------------ pieces
    @functools.cached_property
    def val_batches(self) -> list:
        """``logging.eval_batches`` global batches of the val split, this rank's share; a pipeline evaluates a
        step's worth at once. The same batches at every evaluation."""
        r = self.recipe
        per_batch = r.data.batch_size * (r.optim.grad_accum_steps if self.schedule is not None else 1)
        return self.data.val_batches(r.logging.eval_batches * r.global_batch_size, per_batch, *self.dp)

    def _harness_tasks(self):
        """``logging.eval_tasks`` over this run's live model (evaluation/in_loop.py)."""
        try:  # deferred: an optional dependency (lm-evaluation-harness, the eval extra) and seconds of imports
            from canntrain_core.evaluation.in_loop import InLoopTasks
        except ImportError as e:
            raise BadInput(
                f"logging.eval_tasks runs EleutherAI's lm-evaluation-harness, which is not installed ({e}): "
                "pip install lm_eval (or pip install -e .[eval])"
            ) from None
        r = self.recipe
        length = min(r.data.seq_length, self.model_config.max_position_embeddings)
        return InLoopTasks(self.model, self.data, r.logging, r.data.batch_size, length, self.formats_conversations)

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Validation loss (for instruction data: the mean over trained tokens); with
        ``logging.eval_exact_match``, the share of held-out answers generated exactly; with ``logging.eval_tasks``,
        the harness's ``eval/<task>/<metric>``. No held-out batches (``data.val_fraction: 0``): no loss."""
        self.model.eval()
        tasks = {}
        if self.harness_tasks is not None:
            with self.acc.autocast(self.recipe.model.precision):
                tasks = self.harness_tasks()
        batches = self.val_batches
        if not batches:
            return tasks
        sums, counts = [], []
        for batch in batches:
            x, t, kw = self._model_args(batch)
            n = (t != -100).sum().float()
            with self.acc.autocast(self.recipe.model.precision):
                if self.schedule is not None:
                    self.model.token_weight = self.microbatches if self.token_weighted else None
                    loss = self._pipeline(self.schedule.eval, x, t)
                else:
                    loss = self.model(x, t, **kw)
            sums.append(loss * (1 if self.schedule else n) if self.token_weighted else loss)
            counts.append(n)
        if not self.token_weighted:  # equal rows: the mean of batch means
            val_loss = self._mean_over_ranks(torch.stack(sums).mean())
        else:
            val_loss = self._sum_over_dp(torch.stack(sums).sum()) / self._sum_over_dp(torch.stack(counts).sum())
        out = {"val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 50.0))}
        n_em = self.recipe.logging.eval_exact_match
        sp = self.recipe.distributed.sequence_parallel
        if n_em and self.schedule is None:  # every rank generates the same answers, in lockstep
            out["val_exact_match"], _ = exact_match(
                self.model,
                self.data.eval_examples[:n_em],
                self.data.decode,
                self.data.eos_id,
                cached=not sp,
                multiple_of=self.dims.tp if sp else 1,
            )
        return {**out, **tasks}

    def _write(self, record: dict[str, Any]) -> None:
        if self.rank == 0:
            self.metrics.write(record)

    def save(self) -> Path:
        state = {
            "step": self.step,
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "sampler": self.data.sampler.state_dict(),
            "rng": self.acc.rng_state(),
            "skipped_steps": self.health.skipped_steps,
            "extra": self.extra_state(),
        }
        return checkpoint.save_checkpoint(
            self.ckpt_root,
            self.step,
            self.model,
            self.optimizer,
            state,
            {
                "recipe.resolved.yaml": self.recipe.to_yaml(),
                "config.json": self.model_config.to_json_string(),
                "tokenizer.json": self.data.tokenizer.to_str(),
                **self.tokenizer_metadata,
                **self._base_files(),
                STAGE_FILE: json.dumps(
                    {
                        "train_mode": self.recipe.train_mode,
                        "language_model": self.language_model,
                        "not_a_language_model": self.not_a_language_model,
                    }
                ),
            },
            keep_last=self.recipe.logging.keep_last,
            trainable_only=self.adapters_only,
        )

    @functools.cached_property
    def tokenizer_metadata(self) -> dict[str, str]:
        """What each checkpoint carries beside tokenizer.json, for ``canntrain export`` and ``canntrain
        generate``: tokenizer_config.json (special tokens: the source tokenizer's, or the trained one's EOS),
        the chat template conversations were formatted with (the tokenizer's, or data.template as Jinja;
        none for pretraining) and model.init_from's generation_config.json, when it has one."""
        fmt = self.data.format if self.formats_conversations else None
        given = self._given_tokenizer
        files = tokenizer_files(
            self.data.tokenizer,
            self.data.eos_id,
            given.hf if given is not None else None,
            fmt.chat_template() if fmt is not None else None,
            self.model_config.max_position_embeddings,
        )
        source = Path(self.recipe.model.init_from or "") / "generation_config.json"
        if self.recipe.model.init_from and source.is_file():
            files["generation_config.json"] = source.read_text(encoding="utf-8")
        return files

    def _base_files(self) -> dict[str, str]:
        """A LoRA checkpoint holds adapters only: it names the base they adapt by its fingerprint, which
        ``--merge`` and a resume check against what is at ``model.init_from`` then."""
        if not self.adapters_only:
            return {}
        return {BASE_FINGERPRINT: json.dumps(self.lora_base_fingerprint, indent=1)} if self.rank == 0 else {}

    @functools.cached_property
    def lora_base_fingerprint(self) -> dict[str, str]:
        """The LoRA base's digests (``models.hf.base_fingerprint``), read once: rank 0 checks a resume against
        it and writes it into every checkpoint."""
        return base_fingerprint(self.recipe.model.init_from)

    def _load(self, path: Path) -> None:
        state = checkpoint.load_checkpoint(
            path,
            self.model,
            self.optimizer,
            verify=False,  # verified above
            trainable_only=self.adapters_only,
        )
        self.step = state["step"]
        self.scheduler.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state["scaler"])
        self.data.sampler.load_state_dict(state["sampler"])
        self.acc.set_rng_state(state["rng"])
        self.load_extra_state(state.get("extra", {}))
        self.health.skipped_steps = state.get("skipped_steps", 0)
        if self.rank == 0:
            self.metrics.truncate_after(self.step)
            log.info(f"resumed from {path} at step {self.step}")

    def _inspect_run_dir(self, resume_from: str | Path | None) -> Path | None:
        """The checkpoint to resume from, once the run directory is known to be usable (``check_run_dir``)."""
        check_run_dir(self.run_dir)
        for line in checkpoint.clean_interrupted(self.ckpt_root, self.recipe.logging.keep_last):
            log.info(f"checkpoints: {line}")
        return self._resume_path(resume_from)

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
        damaged = []
        if str(resume_from) == "auto":
            path, damaged = checkpoint.find_resumable(self.ckpt_root)
            if path is None and not damaged:
                log.info(f"resume_from=auto: no checkpoint in {self.ckpt_root}; starting fresh")
        else:
            path = Path(resume_from)
            checkpoint.verify_checkpoint(path)  # a bad explicit path is an error, not a silent fresh start
        if path is not None:  # refuses a recipe the checkpoint cannot load, before anything is touched
            for line in check_resume(
                str(path),
                checkpoint.checkpoint_recipe(path),
                self.recipe,
                checkpoint.checkpoint_config(path),
                self.model_config.to_dict(),
            ):
                log.info(line)
        for bad, error in damaged:  # set aside, so this run can write that step afresh
            moved = checkpoint.set_aside(bad)
            log.info(
                f"resume: {bad.name} is damaged ({str(error).removeprefix(f'{bad}: ')}); moved it aside to {moved.name}"
            )
        if path is None and damaged:
            log.info(f"resume_from=auto: no complete checkpoint left in {self.ckpt_root}; starting fresh")
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
            score=next((r["true_score/mean"] for r in reversed(rows) if "true_score/mean" in r), None),
            val_score=next((r["val_score"] for r in reversed(rows) if "val_score" in r), None),
        )
