#!/usr/bin/env python
"""canntrain's Trainer against transformers' Trainer on the same tiny Llama and data.

Same model (preset, seed), same packed stdlib data, micro-batch, accumulation, precision, optimizer
(AdamW, lr, betas, weight decay, clipping), schedule (warmup + cosine to 0.1 x lr) and steps.
Both run in this one process, alternately, so they see the same machine state.

    python benchmarks/trainer_vs_hf.py [--steps 60] [--rounds 2] [--precision fp32|bf16]

Throughput counts only training steps after the first `--skip` (warm-up), data loading included;
memory is the peak resident set size during training (fit / train, each ending with one checkpoint)
above the size just before it (sampled every 5 ms). Losses: mean of the last 10 steps (how transformers logs).
Prints a markdown table and writes benchmarks/out/trainer_vs_hf.json. Not a test: numbers vary by machine.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time
from pathlib import Path

import torch

from canntrain_core.models import build_model
from canntrain_core.models.init import init_weights, reset_buffers
from canntrain_core.recipe import load_recipe
from canntrain_core.train.metrics import read_metrics
from canntrain_core.train.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "cookbook" / "llama" / "configs" / "tiny_pretrain.yaml"


class PeakRSS:
    """Peak resident set size above the starting size while the block runs."""

    def __enter__(self):
        self.page = os.sysconf("SC_PAGE_SIZE")
        self.start = self.peak = self._rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()
        return self

    def _rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self.page

    def _watch(self):
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, self._rss())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._rss())

    @property
    def bytes(self) -> int:
        return self.peak - self.start


def run_ours(recipe, skip: int) -> dict:
    with tempfile.TemporaryDirectory() as d:
        trainer = Trainer(recipe, run_dir=d, progress=False)
        with PeakRSS() as mem:
            trainer.fit()
        rows = [r for r in read_metrics(d) if "loss" in r]
    timed = [r for r in rows if r["step"] > skip]
    step_time = sum(r["step_time"] for r in timed) / len(timed)
    return {
        "tokens_per_second": recipe.tokens_per_step / step_time,
        "peak_rss_bytes": mem.bytes,
        "losses": {r["step"]: r["loss"] for r in rows},
    }


def window_mean(losses: dict, end: int, width: int) -> float:
    """Mean loss over steps end-width+1 .. end (what transformers logs every `width` steps)."""
    if end in losses and all(s in losses for s in range(end - width + 1, end + 1)):
        return sum(losses[s] for s in range(end - width + 1, end + 1)) / width
    return losses.get(end, float("nan"))


def run_hf(recipe, skip: int) -> dict:
    from transformers import Trainer as HFTrainer, TrainerCallback, TrainingArguments

    from canntrain_core.data import build_data

    r = recipe
    data = build_data(r.data, seed=r.experiment.seed)

    class Shifted(torch.utils.data.Dataset):
        # Our targets are the next tokens; shift_labels tells transformers' loss not to shift again.
        def __len__(self):
            return len(data.train)

        def __getitem__(self, i):
            x = data.train[i]
            return {"input_ids": x[:-1], "labels": x[1:], "shift_labels": x[1:]}

    times: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            times.append(time.perf_counter())

    o = r.optim
    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(),
        per_device_train_batch_size=r.data.batch_size,
        gradient_accumulation_steps=o.grad_accum_steps,
        max_steps=o.max_steps,
        learning_rate=o.lr,
        weight_decay=o.weight_decay,
        adam_beta1=o.betas[0],
        adam_beta2=o.betas[1],
        adam_epsilon=o.eps,
        max_grad_norm=o.grad_clip,
        warmup_steps=o.warmup,
        lr_scheduler_type="cosine_with_min_lr",
        lr_scheduler_kwargs={"min_lr_rate": o.min_lr_ratio},
        logging_steps=10,
        save_strategy="steps",
        save_steps=o.max_steps,
        report_to=[],
        use_cpu=True,
        bf16=r.model.precision == "bf16",
        dataloader_num_workers=r.data.num_workers,
        remove_unused_columns=False,
        disable_tqdm=True,
        seed=r.experiment.seed,
    )
    # The same initial weights as canntrain's (its seeded, layout-independent init), on transformers' model.
    model = build_model(r.model.preset, r.model.overrides, data.vocab_size, device="meta").to_empty(device="cpu")
    init_weights(model, model.config, r.experiment.seed)
    reset_buffers(model, model.config, torch.device("cpu"))
    hf = HFTrainer(model=model, args=args, train_dataset=Shifted(), callbacks=[Clock()])
    with PeakRSS() as mem:
        hf.train()
    losses = {h["step"]: h["loss"] for h in hf.state.log_history if "loss" in h}
    per_step = (times[-1] - times[skip - 1]) / (len(times) - skip)
    return {"tokens_per_second": r.tokens_per_step / per_step, "peak_rss_bytes": mem.bytes, "losses": losses}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--skip", type=int, default=10, help="warm-up steps left out of the timing")
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    a = p.parse_args()
    recipe = load_recipe(
        RECIPE,
        {
            "optim.max_steps": a.steps,
            "model.precision": a.precision,
            "logging.log_interval": 1,
            "logging.eval_interval": 10**6,
            "logging.ckpt_interval": 10**6,
        },
    )
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {recipe.summary()}")
    results: dict[str, list[dict]] = {"canntrain": [], "transformers": []}
    for i in range(a.rounds):
        for name, fn in (("canntrain", run_ours), ("transformers", run_hf)):
            results[name].append(fn(recipe, a.skip))
            print(f"round {i + 1} {name}: {results[name][-1]['tokens_per_second']:.0f} tokens/s")

    def best(name, key):
        return max(x[key] for x in results[name]) if key == "tokens_per_second" else min(x[key] for x in results[name])

    ours, hf = best("canntrain", "tokens_per_second"), best("transformers", "tokens_per_second")
    print(
        f"\n| trainer | tokens/s (best of {a.rounds}) | peak RSS growth (MiB) "
        f"| mean loss, steps {a.steps - 9}-{a.steps} |"
    )
    print("|---|---|---|---|")
    for name in results:
        loss = window_mean(results[name][-1]["losses"], a.steps, 10)
        print(
            f"| {name} | {best(name, 'tokens_per_second'):,.0f} "
            f"| {best(name, 'peak_rss_bytes') / 2**20:.0f} | {loss:.3f} |"
        )
    print(f"\nratio canntrain / transformers: {ours / hf:.2f} ({a.precision}, {a.steps} steps)")
    out = ROOT / "benchmarks" / "out" / f"trainer_vs_hf_{a.precision}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(a), "results": results, "ratio": ours / hf}, indent=1))


if __name__ == "__main__":
    main()
