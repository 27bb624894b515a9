"""Fine-tuning: instruction formats and loss masks, packing, full SFT on the verifiable task, LoRA via peft.

Measured here (tiny Llama pretrained 60 steps on the stdlib, then sft.ipynb's 200 SFT steps of 32 packed rows on
the sort/uppercase task, the run the notebook and these tests share): held-out loss 7.82 -> 1.47, exact match 0.00
-> 0.09 (6 of 64); the test asserts the loss below 0.25 of its start.
LoRA: peft's PeftModel.from_pretrained on the export gives canntrain's logits to 0.0, the merged export
to 3e-6 (tolerance 1e-4); LoRA under FSDP2 on 2 gloo ranks matches one process to ~1e-6.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from tokenizers import pre_tokenizers, trainers

from canntrain_core.checkpoint.export import export_hf
from canntrain_core.data.tokenizer import new_byte_level_bpe
from canntrain_core.errors import BadInput
from canntrain_core.finetune.data import build_sft_data, make_rows, real_tokens, write_jsonl
from canntrain_core.finetune.evaluate import exact_match
from canntrain_core.finetune.format import ChatFormat, Encoded
from canntrain_core.finetune.records import Conversation, parse_record
from canntrain_core.finetune.tasks import task_records
from canntrain_core.jobs.generate import load_generator
from canntrain_core.jobs.layouts import launch_layouts, run_layouts
from canntrain_core.memory import estimate, setup_from_recipe, shape_from_recipe
from canntrain_core.memory.measure import measure_trainer_step
from canntrain_core.sizing.setup import nf4_bytes
from canntrain_core.models.lora import is_adapter, load_with_peft
from canntrain_core.recipe import TemplateConfig, load_recipe
from canntrain_core.train.metrics import read_metrics
from canntrain_core.stages import make_trainer
from canntrain_core.stages.sft import SFTTrainer
from conftest import SFT, TINY, rows_by_step, sort_choice_task, task_data

EOS = "<|endoftext|>"
RECORDS = {
    "alpaca": {"system": "Be brief.", "instruction": "Add", "input": "2 + 3", "output": "5"},
    "messages": {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Add 2 + 3"},
            {"role": "assistant", "content": "5"},
            {"role": "user", "content": "And 4 + 4?"},
            {"role": "assistant", "content": "8"},
        ]
    },
    "sharegpt": {
        "conversations": [
            {"from": "human", "value": "Add 2 + 3"},
            {"from": "gpt", "value": "5"},
            {"from": "human", "value": "And 4 + 4?"},
            {"from": "gpt", "value": "8"},
        ]
    },
}
TRAINED = {  # what each train_on mode trains on, as text (the first token of a sample never is a target)
    ("alpaca", "assistant"): "5" + EOS,
    ("alpaca", "last"): "5" + EOS,
    ("messages", "assistant"): "5" + EOS + "8" + EOS,
    ("messages", "last"): "8" + EOS,
    ("sharegpt", "assistant"): "5" + EOS + "8" + EOS,
    ("sharegpt", "last"): "8" + EOS,
}


@pytest.fixture(scope="module")
def tokenizer():
    tok = new_byte_level_bpe()
    tok.train_from_iterator(
        [json.dumps(r) for r in RECORDS.values()] * 20,
        trainers.BpeTrainer(
            vocab_size=300,
            special_tokens=[EOS],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    return tok


@pytest.mark.parametrize("fmt, train_on", [*TRAINED, ("messages", "all")], ids=lambda v: str(v))
def test_the_loss_mask_covers_exactly_the_trained_tokens(tokenizer, fmt, train_on):
    conv = Conversation("x.jsonl:1", parse_record(RECORDS[fmt]))
    enc = ChatFormat(tokenizer, tokenizer.token_to_id(EOS), TemplateConfig()).encode(conv, train_on)
    trained = tokenizer.decode([t for t, m in zip(enc.ids, enc.trained) if m], skip_special_tokens=False)
    if train_on == "all":
        assert all(enc.trained) and trained.startswith("Be brief.")
    else:
        assert trained == TRAINED[fmt, train_on]
    # generation starts right where the final answer does
    assert tokenizer.decode(enc.ids[enc.prompt_len :], skip_special_tokens=False) == conv.answer + EOS


def test_packed_rows_give_each_sample_the_loss_it_has_alone(tmp_path, data_cache):
    from canntrain_core.models.lifecycle import build_training_model
    from canntrain_core.models.registry import model_config

    src = write_jsonl(tmp_path / "t.jsonl", task_records(40, seed=3))

    def cfg(packing):
        return load_recipe(
            TINY,
            {
                **SFT,
                "data.source": str(src),
                "data.packing": packing,
                "data.tokenizer.vocab_size": 300,
                "data.cache_dir": data_cache,
                "data.val_fraction": 0.0,
                "data.seq_length": 96,
            },
        )

    packed, alone = build_sft_data(cfg(True).data, seed=0), build_sft_data(cfg(False).data, seed=0)
    row = packed.train[0]
    assert int(row["segment_ids"].max()) >= 3  # several samples share the row
    recipe = cfg(True)
    model = build_training_model(recipe, model_config(recipe.model, 300), torch.device("cpu")).model.eval()
    with torch.no_grad():
        for k in range(1, int(row["segment_ids"].max()) + 1):
            sample = row["input_ids"][row["segment_ids"] == k]
            ref_row = next(r for r in alone.train.rows if torch.equal(r["input_ids"][: len(sample)], sample))
            labels = torch.where(row["segment_ids"] == k, row["labels"], torch.tensor(-100))
            got = model(
                row["input_ids"][None, :-1],
                labels[None, 1:],
                position_ids=row["position_ids"][None, :-1],
                segment_ids=row["segment_ids"][None, :-1],
            )
            want = model(ref_row["input_ids"][None, :-1], ref_row["labels"][None, 1:])
            assert abs(got.item() - want.item()) < 1e-5, k  # fp32; measured ~1e-7


@pytest.mark.parametrize("packing", [True, False])
def test_real_tokens_count_the_inputs_that_are_not_padding(packing):
    """Samples of 5, 3 and 10 tokens in rows of 10 (9 inputs, then the last target). By hand: packed, a row of 5 + 3
    (8 real inputs) and one of 10 (9); padded, rows of 5, 3 and 10 (5, 3, 9): 17 either way."""
    samples = [Encoded(list(range(1, n + 1)), [True] * n, 1) for n in (5, 3, 10)]
    rows, _ = make_rows(samples, 10, 0, packing)
    assert len(rows) == (2 if packing else 3)
    assert real_tokens({k: torch.stack([r[k] for r in rows]) for k in rows[0]}) == 17


def test_packing_is_best_fit_decreasing():
    """Samples of 6, 5, 4, 3 and 2 tokens into rows of 10: in arrival order (first fit) they take three rows, 30 %
    padding; longest first, each into the row it fills most tightly (TRL's bfd): 6 + 4 and 5 + 3 + 2, none."""
    samples = [Encoded(list(range(1, n + 1)), [True] * n, 1) for n in (2, 6, 3, 5, 4)]
    rows, stats = make_rows(samples, 10, 0, packing=True)
    lengths = [torch.bincount(r["segment_ids"])[1:].tolist() for r in rows]
    assert lengths == [[6, 4], [5, 3, 2]] and stats["padding_fraction"] == 0


def test_real_tokens_per_second_is_the_intervals_share_of_real_tokens(tmp_path, data_cache):
    """real_tokens_per_second / tokens_per_second over each logged interval is the share of that interval's input
    tokens that were not padding (the rows the steps trained on), not the data set's average."""
    served = []

    class Counted(SFTTrainer):
        def train_step(self, micro_batches):
            served.append(sum(real_tokens(b) for b in micro_batches))
            return super().train_step(micro_batches)

    recipe = load_recipe(
        TINY,
        {
            **SFT,
            "data.source": str(task_data(tmp_path)),
            "data.cache_dir": data_cache,
            "data.packing": False,
            "data.batch_size": 8,
            "optim.max_steps": 6,
            "logging.log_interval": 3,
            "logging.eval_interval": 100,
        },
    )
    Counted(recipe, run_dir=tmp_path / "run", progress=False).fit()
    rows = [r for r in read_metrics(tmp_path / "run") if "real_tokens_per_second" in r]
    per_interval = 3 * 8 * 32
    for r, real in zip(rows, (sum(served[:3]), sum(served[3:]))):
        assert r["real_tokens_per_second"] / r["tokens_per_second"] == pytest.approx(real / per_interval, rel=1e-9)
    assert len(rows) == 2 and sum(served[:3]) != sum(served[3:])  # two intervals, two different shares


def test_sft_on_the_verifiable_task_learns_the_held_out_answers(sft_run):
    rows = [r for r in read_metrics(sft_run.run_dir) if "val_exact_match" in r]
    em, val = [r["val_exact_match"] for r in rows], [r["val_loss"] for r in rows]
    # sft.ipynb's 200 steps: validation loss on the answers' tokens 7.82 -> 1.47 (0.19x), exact match 0.00 -> 0.09 of
    # 64 held-out answers; 250 steps measured 8.2 -> 1.0 to 1.4 and 0.0 to 0.33 over pretraining seeds, data orders
    # and held-out splits. A 1.8M-parameter model's exact match is a steep function of that loss (about eight tokens
    # must all be right), so it is the loss that is asserted; exact match only starts at zero (the pretrained model
    # does not know the task).
    assert em[0] <= 0.05, em
    assert val[-1] < 0.25 * val[0], val
    # the batched KV-cached decode (the default) gives the answers of the plain one-prompt-at-a-time decode
    t = sft_run.trainer
    cached, plain = (
        exact_match(t.model, t.data.eval_examples[:24], t.data.decode, t.data.eos_id, cached=c) for c in (True, False)
    )
    assert cached == plain and len(cached[1]) == 24


def test_sft_resume_is_bit_exact(pretrained, tmp_path, data_cache):
    recipe = load_recipe(
        None,
        {
            **SFT,
            "model.init_from": str(pretrained),
            "data.source": task_data(tmp_path, 600),
            "data.cache_dir": data_cache,
            "data.batch_size": 4,
            "optim.max_steps": 8,
            "optim.grad_accum_steps": 2,
            "logging.eval_interval": 4,
            "logging.ckpt_interval": 4,
        },
    )
    make_trainer(recipe, run_dir=tmp_path / "full", progress=False).fit()
    make_trainer(recipe, run_dir=tmp_path / "cut", progress=False).fit(stop_after=4)
    make_trainer(recipe, run_dir=tmp_path / "cut", resume_from="auto", progress=False).fit()
    full, cut = ({r["step"]: r["loss"] for r in read_metrics(tmp_path / d) if "loss" in r} for d in ("full", "cut"))
    assert sorted(full) == list(range(1, 9)) and full == cut


def test_lora_trains_only_adapters_and_exports_what_peft_and_transformers_load(pretrained, tmp_path, data_cache):
    from transformers import AutoModelForCausalLM

    base = tmp_path / "base"  # a copy: replaced below
    shutil.copytree(pretrained, base)
    recipe = load_recipe(
        None,
        {
            **SFT,
            "model.init_from": str(base),
            "data.source": task_data(tmp_path, 600),
            "data.cache_dir": data_cache,
            "lora.enabled": True,
            "optim.max_steps": 20,
            "data.batch_size": 8,
            "optim.lr": 3e-2,
            "logging.eval_interval": 20,
        },
    )
    trainer = make_trainer(recipe, run_dir=tmp_path / "run", progress=False)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.fit()
    after = dict(trainer.model.named_parameters())
    assert all(torch.equal(before[n], after[n]) for n in before if "lora_" not in n)  # base bit-identical
    assert all(not torch.equal(before[n], after[n]) for n in before if "lora_B" in n)  # adapters trained
    ckpt = tmp_path / "run" / "checkpoints" / "step_20"
    stored = sum(p.stat().st_size for p in ckpt.glob("*.distcp"))
    # adapter-only: adapters + their AdamW moments, against 3 x the model for a full checkpoint (measured 4 %)
    assert stored < 0.1 * 3 * sum(p.numel() * 4 for p in after.values())
    adapter, merged = (
        export_hf(tmp_path / "run", tmp_path / "adapter"),
        export_hf(tmp_path / "run", tmp_path / "merged", merge=True),
    )
    assert (adapter.out / "adapter_config.json").is_file() and adapter.files == ["adapter_model.safetensors"]
    ids = torch.randint(0, 4096, (2, 16), generator=torch.Generator().manual_seed(0))
    trainer.model.eval()
    with torch.no_grad():
        ours = trainer.model(ids)
        peft_model = load_with_peft(pretrained, adapter.out)
        assert (peft_model(ids).logits - ours).abs().max() <= 1e-5
        assert (AutoModelForCausalLM.from_pretrained(merged.out)(ids).logits - ours).abs().max() <= 1e-4
    # the base replaced by other weights at the same path: merging or resuming onto it is refused
    other = AutoModelForCausalLM.from_pretrained(base)
    with torch.no_grad():
        other.model.norm.weight.mul_(2)
    other.save_pretrained(base)
    for attempt in (
        lambda: export_hf(tmp_path / "run", tmp_path / "merged2", merge=True),
        lambda: make_trainer(recipe, run_dir=tmp_path / "run", resume_from="auto", progress=False),
        lambda: load_generator(tmp_path / "run"),  # generate folds the adapters into the base as --merge does
    ):
        with pytest.raises(BadInput, match=r"the LoRA base .*base is not the model .*\(model.safetensors changed"):
            attempt()
    assert not (tmp_path / "merged2").exists()


def _lora_recipe(pretrained, tasks: str, data_cache: str, **extra):
    """20 LoRA steps of 8 rows on the task at the tiny recipe's learning rate, every step logged, a checkpoint at 10."""
    return load_recipe(
        None,
        {
            **SFT,
            "model.init_from": str(pretrained),
            "data.source": tasks,
            "data.cache_dir": data_cache,
            "lora.enabled": True,
            "optim.max_steps": 20,
            "data.batch_size": 8,
            "optim.lr": 3e-3,
            "logging.log_interval": 1,
            "logging.eval_interval": 20,
            "logging.ckpt_interval": 10,
            **extra,
        },
    )


def _resumes_bit_exactly(recipe, full: Path) -> None:
    """``recipe`` stopped at step 10 and resumed logs what the uninterrupted run in ``full`` logged."""
    cut = full.parent / f"{full.name}_cut"
    make_trainer(recipe, run_dir=cut, progress=False).fit(stop_after=10)
    make_trainer(recipe, run_dir=cut, resume_from="auto", progress=False).fit()
    assert rows_by_step(cut) == rows_by_step(full)


def _peft_loads_the_adapter(pretrained, run_dir: Path, adapters: dict) -> None:
    """peft's own loader reads the run's exported adapter as ``adapters``, written in the recipe's bf16 (export's
    default dtype), as peft then holds them."""
    peft_model = load_with_peft(pretrained, export_hf(run_dir, run_dir.parent / f"{run_dir.name}_adapter").out)
    theirs = {n.replace("base_model.model.", ""): p for n, p in peft_model.named_parameters() if is_adapter(n)}
    assert len(theirs) == len(adapters)
    assert all(torch.equal(theirs[n], p.to(torch.bfloat16).float()) for n, p in adapters.items())


def test_a_lora_base_is_held_in_16_bits_and_trains_as_an_fp32_base_does(pretrained, tmp_path, data_cache):
    """model.precision bf16: the frozen base stored in bf16 (no fp32 master, no autocast copy), the adapters and
    their AdamW states in fp32. Measured (20 steps at the tiny recipe's lr): losses within 0.016 of the fp32 run's
    (bf16 autocast over an fp32 base, as before this, was 0.017 off); the step's peak 22.8 MB against 29.1 MB for the
    same trainer with its base cast back to fp32 (the tracker memory_estimation.ipynb uses), 6.3 MB less where the
    base's 1.84 M parameters at 2 bytes fewer each are 3.7 MB; resumed bit-exactly; peft loads the adapter."""
    tasks = task_data(tmp_path, 600)

    def recipe(precision):
        return _lora_recipe(pretrained, tasks, data_cache, **{"model.precision": precision})

    for precision in ("fp32", "bf16"):
        trainer = make_trainer(recipe(precision), run_dir=tmp_path / precision, progress=False)
        trainer.fit()
    base = [p for n, p in trainer.model.named_parameters() if not is_adapter(n)]
    adapters = {n: p for n, p in trainer.model.named_parameters() if is_adapter(n)}
    assert {p.dtype for p in base} == {torch.bfloat16} and {p.dtype for p in adapters.values()} == {torch.float32}
    states = {v.dtype for s in trainer.optimizer.state.values() for v in s.values() if v.ndim}
    assert states == {torch.float32} and len(trainer.optimizer.state) == len(adapters)
    fp32, bf16 = ([r["loss"] for r in read_metrics(tmp_path / p) if "loss" in r] for p in ("fp32", "bf16"))
    assert len(bf16) == 20 and max(abs(a - b) for a, b in zip(fp32, bf16)) < 0.05, (fp32, bf16)

    _resumes_bit_exactly(recipe("bf16"), tmp_path / "bf16")
    _peft_loads_the_adapter(pretrained, tmp_path / "bf16", adapters)

    held = measure_trainer_step(trainer).peak  # last: it takes a step
    for p in base:
        p.data = p.data.float()  # the base as it was held before: fp32, copied to bf16 by autocast
    assert measure_trainer_step(trainer).peak - held >= 2 * sum(p.numel() for p in base)


def test_a_qlora_base_is_4_bit_nf4_trains_resumes_and_exports(pretrained, tmp_path, data_cache):
    """lora.load_in_4bit: the blocks' linear layers held as bitsandbytes' NF4 (half a byte a weight), the rest of the
    base bf16. Measured (20 steps): losses within 0.093 of the bf16 base's; resumed bit-exactly; the adapter loads
    with peft and --merge folds it into the unquantized base; its parameters are the estimator's to the byte."""
    bnb = pytest.importorskip("bitsandbytes")
    tasks = task_data(tmp_path, 600)

    def recipe(four_bit):
        # an evaluation between steps: the 4-bit layers keep their backward after running in eval mode
        extra = {"model.precision": "bf16", "lora.load_in_4bit": four_bit, "logging.eval_interval": 10}
        return _lora_recipe(pretrained, tasks, data_cache, **extra)

    for name, four_bit in (("bf16", False), ("nf4", True)):
        trainer = make_trainer(recipe(four_bit), run_dir=tmp_path / name, progress=False)
        trainer.fit()
    linears = [m for layer in trainer.model.layers() for m in layer.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(linears) == 7 * len(list(trainer.model.layers()))  # q, k, v, o, gate, up, down
    plain = [m for layer in trainer.model.layers() for m in layer.modules() if type(m) is torch.nn.Linear]
    assert all(m.weight.requires_grad for m in plain)  # what is left plain is the adapters' A and B
    bf16, nf4 = ([r["loss"] for r in read_metrics(tmp_path / p) if "loss" in r] for p in ("bf16", "nf4"))
    assert len(nf4) == 20 and max(abs(a - b) for a, b in zip(bf16, nf4)) < 0.3, (bf16, nf4)

    _resumes_bit_exactly(recipe(True), tmp_path / "nf4")
    adapters = {n: p for n, p in trainer.model.named_parameters() if is_adapter(n)}
    _peft_loads_the_adapter(pretrained, tmp_path / "nf4", adapters)
    assert (export_hf(tmp_path / "nf4", tmp_path / "merged", merge=True).out / "config.json").is_file()

    est = estimate(shape_from_recipe(trainer.recipe), setup_from_recipe(trainer.recipe))
    linear = sum(m.in_features * m.out_features for m in linears)
    rest = sum(p.numel() for n, p in trainer.model.named_parameters() if p.dtype == torch.bfloat16)
    assert est.states["parameters"] == 2 * rest + nf4_bytes(linear) + 4 * sum(p.numel() for p in adapters.values())


def test_sft_and_lora_under_fsdp2_tp2_sp_and_cp2_on_2_ranks_match_one_process(sft_run, tmp_path, data_cache):
    # from the fine-tuned model, so that the held-out answers decoded in lockstep by every rank are some right
    base = {
        **SFT,
        "model.init_from": str(sft_run.hf),
        "data.source": task_data(tmp_path, 1000),
        "data.cache_dir": data_cache,
        "data.batch_size": 8,
        "optim.max_steps": 6,
        "logging.eval_interval": 6,
        "optim.lr": 1e-3,  # 3e-3 knocks the fine-tuned model's few right answers to none in 6 steps
        "logging.eval_exact_match": 16,  # 1 to 2 of 16 right at step 0 (8 can hold none)
    }
    lora = {"lora.enabled": True, "lora.dropout": 0.0}  # dropout draws differ by layout
    # the harness in the loop (logging.eval_tasks): every rank evaluates the same items in lockstep
    harness = {
        "logging.eval_tasks": ["canntrain_upper", sort_choice_task(tmp_path / "harness", 8)],
        "logging.eval_tasks_limit": 8,
        "logging.eval_include_path": str(tmp_path / "harness"),
    }
    layouts = {"sft": harness, "lora": lora, "lora16": {**lora, "model.precision": "bf16"}}  # lora16: a bf16 base
    fsdp = {"distributed.data_parallel_size": 2, "distributed.zero_optimization": 3, "data.batch_size": 4}
    tp2_sp = {"distributed.tensor_parallel_size": 2, "distributed.sequence_parallel": True}  # the packed mask under SP
    cp2 = {"distributed.context_parallel_size": 2, "distributed.zero_optimization": 3}  # packed rows cut in 4 chunks
    tp2 = {**harness, "distributed.tensor_parallel_size": 2}
    run_layouts(str(TINY), tmp_path, base, [f"{k}_single={json.dumps(v)}" for k, v in layouts.items()])
    launch_layouts(
        TINY,
        tmp_path,
        2,
        base,
        {
            **{f"{k}_fsdp2": {**v, **fsdp} for k, v in layouts.items()},
            "sft_tp2sp": tp2_sp,
            "sft_cp2": cp2,
            "sft_tp2": tp2,
        },
    )
    for k in ("sft_fsdp2", "sft_tp2"):  # the harness's scores of 2 ranks are those of one process
        one, two = ({r["step"]: r for r in read_metrics(tmp_path / n)} for n in ("sft_single", k))
        scores = [{m: row[m] for m in row if m.startswith("eval/")} for row in (one[0], one[6], two[0], two[6])]
        assert len(scores[0]) == 2 and scores[0]["eval/sort_choice/acc"] > 0, scores[0]
        assert scores[:2] == scores[2:], k
    pairs = [("sft_fsdp2", "sft_single"), ("lora_fsdp2", "lora_single"), ("sft_tp2sp", "sft_single")]
    for k, ref in pairs + [("sft_cp2", "sft_single"), ("sft_tp2", "sft_single")]:
        one, two = ({r["step"]: r for r in read_metrics(tmp_path / n)} for n in (ref, k))
        assert max(abs(one[s]["loss"] - two[s]["loss"]) for s in range(1, 7)) < 2e-4, k
        assert abs(one[6]["val_loss"] - two[6]["val_loss"]) < 2e-4, k
        assert one[0]["val_exact_match"] > 0 and one[6]["val_exact_match"] > 0, one
        assert [one[s]["val_exact_match"] for s in (0, 6)] == [two[s]["val_exact_match"] for s in (0, 6)], k
    # the bf16 base sharded by FSDP2 beside its fp32 adapters: one process's losses to bf16's rounding (3e-4 measured)
    one, two = ({r["step"]: r for r in read_metrics(tmp_path / n)} for n in ("lora16_single", "lora16_fsdp2"))
    assert max(abs(one[s]["loss"] - two[s]["loss"]) for s in range(1, 7)) < 2e-3
    assert abs(one[6]["val_loss"] - two[6]["val_loss"]) < 2e-3


def test_a_tokenizers_own_chat_template_formats_and_masks(tokenizer):
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS)
    hf.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}"
        "{% if m['role'] == 'assistant' %}" + EOS + "{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    conv = Conversation("x.jsonl:1", parse_record(RECORDS["messages"]))
    fmt = ChatFormat(tokenizer, tokenizer.token_to_id(EOS), TemplateConfig(), chat_template=hf)
    enc = fmt.encode(conv, "assistant")
    text = tokenizer.decode(enc.ids, skip_special_tokens=False)
    assert text.startswith("<system>Be brief.<user>Add 2 + 3<assistant>5" + EOS)
    trained = tokenizer.decode([t for t, m in zip(enc.ids, enc.trained) if m], skip_special_tokens=False)
    assert trained == "5" + EOS + "8" + EOS
