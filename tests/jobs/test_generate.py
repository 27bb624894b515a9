"""Tokenizer and generation metadata through a model's life, and `canntrain generate`.

- a chat template is read wherever transformers keeps it (chat_template.jinja, tokenizer_config.json,
  additional_chat_templates/), through the one loading path every stage's data builder takes;
- a run carries its tokenizer's special tokens, the chat template it formatted conversations with (the
  tokenizer's, or data.template as Jinja) and its source's generation_config.json into every checkpoint
  and out through the export, so transformers alone prompts an exported model exactly as training did;
- `canntrain generate` on a run, a checkpoint or an export answers what transformers' greedy
  `generate` answers.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

from canntrain_core.checkpoint.export import export_hf
from canntrain_core.cli import main
from canntrain_core.data.cache import DataError
from canntrain_core.data.tokenizer import chat_template_source, pretrained_tokenizer
from canntrain_core.finetune.records import read_conversations
from canntrain_core.jobs.generate import load_generator
from canntrain_core.recipe import load_recipe
from canntrain_core.stages import make_trainer
from conftest import BAD_INPUTS, SFT, task_data, write_hf_model

TOKENIZER = BAD_INPUTS / "data" / "tiny_hf" / "tokenizer.json"  # 300 byte-level tokens
EOS = "<|endoftext|>"
CHATML = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SOURCE_GENERATION = {
    "bos_token_id": 300,
    "eos_token_id": [0, 301],
    "pad_token_id": 301,
    "do_sample": True,
    "temperature": 0.7,
    "top_p": 0.9,
}


def write_chat_model(path: Path, template=CHATML, where: str = "jinja", generation: dict | None = None) -> Path:
    """A tiny random Llama and a tokenizer with bos, eos and pad, written by transformers' own save_pretrained;
    its chat template in chat_template.jinja (``where="jinja"``), tokenizer_config.json ("config") or, with
    a dict, chat_template.jinja plus additional_chat_templates/ ("jinja")."""
    from tokenizers import Tokenizer

    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=320,
        max_position_embeddings=128,
        bos_token_id=300,
        eos_token_id=0,
        pad_token_id=301,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_file(str(TOKENIZER)), bos_token="<s>", eos_token=EOS, pad_token="<pad>"
    )
    tok.chat_template = template
    tok.save_pretrained(path, save_jinja_files=where == "jinja")
    if generation is not None:
        GenerationConfig(**generation).save_pretrained(path)
    return path


@pytest.mark.parametrize(
    "where, template",
    [
        ("jinja", CHATML),
        ("config", CHATML),
        ("jinja", {"default": CHATML, "tool_use": "{{ 'tools' }}"}),
        ("config", {"default": CHATML, "tool_use": "{{ 'tools' }}"}),
    ],
    ids=["chat_template.jinja", "tokenizer_config.json", "named-jinja", "named-config"],
)
def test_a_chat_template_is_read_wherever_transformers_keeps_it(tmp_path, where, template):
    d = write_chat_model(tmp_path / "hf", template, where)
    expected = {"jinja": d / "chat_template.jinja", "config": d / "tokenizer_config.json"}[where]
    assert chat_template_source(d) == expected
    config = LlamaConfig.from_pretrained(d)
    picked = pretrained_tokenizer(d, config, "auto")
    assert picked["chat_template"].chat_template == template
    assert picked["tokenizer"].hf.bos_token == "<s>" and picked["tokenizer"].hf.pad_token == "<pad>"
    assert pretrained_tokenizer(d, config, "tokenizer")["chat_template"] is not None
    assert pretrained_tokenizer(d, config, "recipe")["chat_template"] is None
    assert "chat_template" not in pretrained_tokenizer(d, config)  # pretraining asks for none

    (expected if where == "config" else d / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOS}))
    if where == "jinja":
        (d / "chat_template.jinja").unlink()
        shutil.rmtree(d / "additional_chat_templates", ignore_errors=True)
    assert chat_template_source(d) is None
    assert pretrained_tokenizer(d, config, "auto")["chat_template"] is None
    with pytest.raises(DataError, match="data.chat_template=tokenizer: .* has no chat template"):
        pretrained_tokenizer(d, config, "tokenizer")


def _sft(tmp_path, init_from, data_cache, steps=2, **extra):
    recipe = load_recipe(
        None,
        {
            **SFT,
            "model.init_from": str(init_from),
            "data.source": task_data(tmp_path, 200),
            "data.cache_dir": data_cache,
            "data.batch_size": 4,
            "optim.max_steps": steps,
            "optim.warmup_steps": 1,
            "logging.eval_interval": steps,
            **extra,
        },
    )
    trainer = make_trainer(recipe, run_dir=tmp_path / "run", progress=False)
    trainer.fit()
    return trainer


def test_a_run_carries_the_tokenizers_template_special_tokens_and_generation_config(tmp_path, data_cache):
    src = write_chat_model(tmp_path / "hf", generation=SOURCE_GENERATION)
    trainer = _sft(tmp_path, src, data_cache)
    info = json.loads((tmp_path / "run" / "data.json").read_text())
    assert info["chat_template"] == str(src / "chat_template.jinja")
    ckpt = trainer.result().checkpoints[-1]
    assert {"tokenizer_config.json", "chat_template.jinja", "generation_config.json"} <= set(
        json.loads((ckpt / "manifest.json").read_text())["files"]
    )  # hashed with the rest
    out = export_hf(tmp_path / "run", tmp_path / "out").out

    tok = AutoTokenizer.from_pretrained(out)
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<s>", EOS, "<pad>")
    assert tok.chat_template == CHATML
    conv = read_conversations(trainer.recipe.data.source)[0][0]
    messages = [{"role": r, "content": c} for r, c in conv.turns[:-1]]
    enc = trainer.data.format.encode(conv, "last")
    ids = tok.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
    assert ids == enc.ids[: enc.prompt_len] and ids[0] == tok.bos_token_id  # prompted exactly as trained
    gen = GenerationConfig.from_pretrained(out)
    assert gen.eos_token_id == [0, 301] and (gen.temperature, gen.top_p, gen.do_sample) == (0.7, 0.9, True)
    # canntrain generate stops at any of the source's end tokens, from the checkpoint as from the export
    assert load_generator(out, "cpu").end_ids == load_generator(tmp_path / "run", "cpu").end_ids == (0, 301)


def test_data_chat_template_recipe_formats_and_exports_data_template(tmp_path, data_cache):
    src = write_chat_model(tmp_path / "hf")
    _sft(tmp_path, src, data_cache, **{"data.chat_template": "recipe"})
    assert json.loads((tmp_path / "run" / "data.json").read_text())["chat_template"] == "data.template"
    tok = AutoTokenizer.from_pretrained(export_hf(tmp_path / "run", tmp_path / "out").out)
    text = tok.apply_chat_template(
        [{"role": "user", "content": "Sort: 3 1"}, {"role": "assistant", "content": "1 3"}], tokenize=False
    )
    assert text == "Sort: 3 1 = 1 3" + EOS  # conftest's SFT data.template, not the tokenizer's
    assert (tok.bos_token, tok.pad_token) == ("<s>", "<pad>")  # the special tokens stay the source's


def test_a_pretraining_export_says_eos_and_has_no_chat_template(pretrained, capfd):
    tok = AutoTokenizer.from_pretrained(pretrained)
    assert tok.eos_token == EOS and tok.pad_token is None and tok.chat_template is None
    assert GenerationConfig.from_pretrained(pretrained).eos_token_id == tok.eos_token_id  # from config.json
    assert main(["generate", str(pretrained), "--prompt", "def ", "--max-new-tokens", "8"]) == 0
    assert capfd.readouterr().out.strip()
    assert main(["generate", str(pretrained), "--prompt", "def ", "--chat"]) == 2
    err = capfd.readouterr().err
    assert err.startswith("canntrain generate: --chat: ") and "has no chat template" in err and "\n" == err[-1:]
    assert err.count("\n") == 1


def test_an_sft_export_answers_with_transformers_alone_as_canntrain_generate_does(sft_run, capfd):
    """The export's chat template is the SFT recipe's data.template as Jinja: transformers' apply_chat_template
    gives the prompt ids training used, its greedy generate the answer canntrain generate gives."""
    out = sft_run.hf
    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    fmt = sft_run.trainer.data.format
    convs = read_conversations(sft_run.tasks)[0][:16]
    ours = load_generator(out, "cpu")
    from_run = load_generator(sft_run.run_dir, "cpu")  # its newest checkpoint
    prompts = [c.turns[-2][1] for c in convs]
    done = ours.generate(prompts, chat=True, max_new_tokens=12)
    assert [c.ids for c in done] == [c.ids for c in from_run.generate(prompts, chat=True, max_new_tokens=12)]
    formatted = 0
    for conv, c in zip(convs, done):
        enc = fmt.encode(conv, "last")
        ids = tok.apply_chat_template(
            [{"role": "user", "content": conv.turns[-2][1]}], add_generation_prompt=True, return_tensors="pt"
        )["input_ids"]
        assert ids[0].tolist() == enc.ids[: enc.prompt_len] == c.prompt_ids
        with torch.no_grad():
            theirs = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=12,
                pad_token_id=tok.eos_token_id,
            )[0, ids.shape[1] :].tolist()
        assert c.ids == theirs[: len(c.ids)] and c.ended == (tok.eos_token_id in theirs)
        assert c.text == tok.decode(theirs[: len(c.ids) - c.ended])
        formatted += bool(re.fullmatch(r"[0-9A-Z]( [0-9A-Z])*", c.text.strip()))
    # the fine-tuned model answers in the task's format (which answers are right varies with the run: 0.0 to 0.33)
    assert formatted >= 12, [c.text for c in done]
    # the command line prints the same answers
    assert (
        main(
            [
                "generate",
                str(sft_run.run_dir),
                "--chat",
                "--max-new-tokens",
                "12",
                *[a for p in prompts for a in ("--prompt", p)],
            ]
        )
        == 0
    )
    printed = capfd.readouterr().out
    assert all(f"[{i + 1}] {p}\n{c.text}\n" in printed for i, (p, c) in enumerate(zip(prompts, done)))


def test_generate_from_a_lora_run_folds_its_adapters_into_the_base(pretrained, tmp_path, data_cache):
    base = tmp_path / "base"
    shutil.copytree(pretrained, base)
    _sft(tmp_path, base, data_cache, steps=3, **{"lora.enabled": True, "optim.lr": 3e-2})
    merged = export_hf(tmp_path / "run", tmp_path / "merged", merge=True).out
    a = load_generator(tmp_path / "run", "cpu").generate(
        ["Sort the digits: 3 1 2", "Uppercase: ab"], chat=True, max_new_tokens=6
    )
    b = load_generator(merged, "cpu").generate(["Sort the digits: 3 1 2", "Uppercase: ab"], chat=True, max_new_tokens=6)
    assert [c.ids for c in a] == [c.ids for c in b]
    adapter = export_hf(tmp_path / "run", tmp_path / "adapter").out
    with pytest.raises(Exception, match="a peft adapter without its base"):
        load_generator(adapter, "cpu")


def test_generate_from_a_moe_lora_run_and_its_merged_export_equals_transformers(tmp_path, data_cache):
    """A MoE model's LoRA run: its base's experts are the files' own tensors (models/hf_names.py), read by
    canntrain's names for the run and the merged export alike."""
    base = tmp_path / "base"
    write_hf_model(base, family="qwen3_moe")
    _sft(tmp_path, base, data_cache, steps=2, **{"lora.enabled": True, "optim.lr": 3e-2})
    merged = export_hf(tmp_path / "run", tmp_path / "merged", merge=True).out
    prompts = ["Sort the digits: 3 1 2", "Uppercase: ab"]
    a = load_generator(tmp_path / "run", "cpu").generate(prompts, chat=True, max_new_tokens=6)
    b = load_generator(merged, "cpu").generate(prompts, chat=True, max_new_tokens=6)
    assert [c.ids for c in a] == [c.ids for c in b]
    hf = AutoModelForCausalLM.from_pretrained(merged)
    for c in b:
        theirs = hf.generate(torch.tensor([c.prompt_ids]), do_sample=False, max_new_tokens=6, pad_token_id=0)
        assert theirs[0, len(c.prompt_ids) :][: len(c.ids)].tolist() == c.ids


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--prompt", "x", "--system", "be brief"],
            "--system: a system prompt goes into the chat template; add --chat",
        ),
        (["--prompt", "x", "--max-new-tokens", "0"], "--max-new-tokens 0: must be at least 1"),
        (
            ["--prompt", "x", "--max-new-tokens", "5000"],
            "a 1-token prompt + --max-new-tokens 5000 is longer than the model's 2048 positions",
        ),
        (
            [
                "--prompt",
                "",
            ],
            "--prompt: empty",
        ),
    ],
)
def test_generate_bad_arguments_are_one_line(pretrained, capfd, args, message):
    assert main(["generate", str(pretrained), *args]) == 2
    err = capfd.readouterr().err
    assert err.startswith(f"canntrain generate: {message}") and err.count("\n") == 1
