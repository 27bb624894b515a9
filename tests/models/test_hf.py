"""Hugging Face in and out: a model written by transformers' own save_pretrained starts a canntrain run,
and what canntrain exports loads back with transformers' own from_pretrained.

Measured here (fp32, CPU): init_from logits equal transformers' to 0.0 in one process and 4.8e-7 under
FSDP2 x TP2 on 4 gloo ranks (reduction order); export -> from_pretrained logits equal canntrain's to 0.0.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

import _hf_ranks
from canntrain_core.cli import main
from canntrain_core.data import build_data, pretrained_tokenizer
from canntrain_core.errors import BadInput
from canntrain_core.checkpoint.export import export_hf
from canntrain_core.families import FAMILIES
from canntrain_core.jobs.generate import load_generator
from canntrain_core.jobs.local_ranks import run_local_ranks
from canntrain_core.models.lifecycle import build_training_model
from canntrain_core.models.registry import model_config
from canntrain_core.recipe import load_recipe
from canntrain_core.train.trainer import Trainer
from conftest import write_hf_model

VOCAB = 300
LOGITS_TOL = 1e-5  # fp32; measured 0.0 (one process) and 4.8e-7 (4 ranks)
IDS = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory) -> dict:
    """Every family's tiny model (canntrain_core/families/), written by transformers: name -> (dir, model)."""
    root = tmp_path_factory.mktemp("hf")
    return {name: (root / f"tiny-{name}", write_hf_model(root / f"tiny-{name}", family=name)) for name in FAMILIES}


@pytest.fixture(scope="module")
def hf_dir(family_dirs):
    return family_dirs["llama"]


@pytest.fixture(params=list(FAMILIES))
def family_dir(request, family_dirs):
    return family_dirs[request.param]


def recipe_from(hf_path, data_cache=None, **extra):
    keys = {"model.init_from": str(hf_path), "experiment.seed": 7}
    if data_cache:
        keys.update(
            {
                "data.cache_dir": data_cache,
                "data.source": "stdlib",
                "data.max_bytes": 100_000,
                "data.seq_length": 32,
                "data.batch_size": 4,
                "optim.max_steps": 4,
                "optim.warmup_steps": 1,
                "logging.log_interval": 1,
                "logging.eval_interval": 4,
                "logging.eval_batches": 1,
                "logging.ckpt_interval": 4,
            }
        )
    return load_recipe(None, {**keys, **extra})


def test_init_from_gives_the_same_logits_as_transformers(family_dir):
    path, hf = family_dir
    recipe = recipe_from(path)
    built = build_training_model(recipe, model_config(recipe.model), torch.device("cpu"))
    assert len({row["file"] for row in built.loaded}) > 3  # read from several shards
    with torch.no_grad():
        assert (built.model(IDS) - hf(IDS).logits).abs().max() <= LOGITS_TOL


WINDOWED = {  # Mistral v0.1 windows every layer; Qwen2's use_sliding_window the layers from max_window_layers on
    "mistral": dict(sliding_window=16),
    "qwen2": dict(use_sliding_window=True, sliding_window=16, max_window_layers=2),
}


@pytest.mark.parametrize("family", list(WINDOWED))
def test_sliding_window_attention_gives_transformers_logits_and_decodes_alike(family, tmp_path):
    """Sequences three times the window: transformers' logits (which the plain causal attention misses by far),
    and KV-cached decoding past the window equal to the full forward at every position."""
    from transformers import DynamicCache

    hf = write_hf_model(tmp_path / family, family=family, **WINDOWED[family])
    recipe = recipe_from(tmp_path / family)
    model = build_training_model(recipe, model_config(recipe.model), torch.device("cpu")).model.eval()
    ids = torch.randint(0, VOCAB, (2, 48), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full, want = model(ids), hf(ids).logits
        assert (full - want).abs().max() <= LOGITS_TOL
        windows, model.windows = model.windows, [None] * len(model.windows)
        assert (model(ids) - want).abs().max() > 100 * LOGITS_TOL  # the window matters at this length
        model.windows = windows
        cache, step = DynamicCache(), []  # as models.rollout decodes
        for t in range(ids.shape[1]):
            seen = torch.ones(2, 1, 1, t + 1, dtype=torch.bool)
            step.append(model(ids[:, t : t + 1], position_ids=torch.full((2, 1), t), attention_mask=seen, cache=cache))
    assert (torch.cat(step, dim=1) - full).abs().max() <= LOGITS_TOL


@pytest.fixture(scope="module")
def four_ranks(family_dirs, tmp_path_factory) -> Path:
    """One 4-rank launch for every family: FSDP2 x TP2 and PP2 x FSDP2, seeded and from init_from, and SGD steps
    under FSDP2 x TP2 (tests/_hf_ranks.py)."""
    out = tmp_path_factory.mktemp("hf-ranks")
    run_local_ranks(_hf_ranks.main, (str(out), *(str(path) for path, _ in family_dirs.values())), 4, out / "logs")
    return out


def _refused(out: Path, family: str, layout: str) -> str:
    """Why the trainer refuses ``layout`` for ``family`` ('' when it runs it): tests/_hf_ranks.py wrote it."""
    path = out / f"{family}-{layout}-init-refused.txt"
    return path.read_text() if path.is_file() else ""


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_4_rank_layouts_load_the_same_logits_and_initialise_the_same_weights(family, family_dirs, four_ranks):
    path, hf = family_dirs[family]
    recipe = load_recipe(
        None, {"experiment.seed": 7, "model.preset": FAMILIES[family].tiny, "model.overrides": {"vocab_size": VOCAB}}
    )
    single = build_training_model(recipe, model_config(recipe.model), torch.device("cpu")).model
    want = {n: p.detach() for n, p in single.named_parameters()}
    # a tied preset has no pipeline layout (the embedding and the head would sit on different stages)
    layouts = ("fsdp2_tp2", "fsdp2_tp2_sp", "pp2_fsdp2", "ep2_fsdp2", "ep2_tp2_sp")
    run = [layout for layout in layouts if (four_ranks / f"{family}-{layout}-init-rank0.pt").is_file()]
    assert run, [_refused(four_ranks, family, layout) for layout in layouts]
    for layout in run:
        got = {}
        for rank in range(4):
            got.update(torch.load(four_ranks / f"{family}-{layout}-init-rank{rank}.pt")["params"])
        assert sorted(got) == sorted(want)
        assert all(torch.equal(got[n], want[n]) for n in want), layout  # bit for bit
    saved = torch.load(four_ranks / f"{family}-{run[0]}-hf-rank0.pt")  # FSDP2 x TP2 (a mixture of experts: EP2 x FSDP2)
    with torch.no_grad():
        assert (saved["logits"] - hf(IDS).logits).abs().max() <= LOGITS_TOL
    q = next(r for r in saved["loaded"] if r["tensor"] == "model.layers.0.self_attn.q_proj.weight")
    rows = single.model.layers[0].self_attn.q_proj.out_features  # rank 0's quarter: TP rows then FSDP's half, or FSDP's
    assert q["shape"] == [rows, 128] and q["slice"] == f"[0:{rows // 4}, 0:128]"
    if FAMILIES[family].router_class:  # rank 0 holds experts 0-1 of 8 (ep's half, FSDP2's half): it reads theirs only
        read = {r["slice"].split(",")[0] for r in saved["loaded"] if ".experts." in r["tensor"]}
        assert read == {"[0:2"}, read


# a mixture of experts runs under EP x FSDP2, and with attention under TP2 + SP (tests/_hf_ranks.py)
SGD_LAYOUTS = [
    (family, layout)
    for family, f in FAMILIES.items()
    for layout in (("ep2_fsdp2", "ep2_tp2_sp") if f.router_class else ("fsdp2_tp2", "fsdp2_tp2_sp"))
]


@pytest.mark.slow
@pytest.mark.parametrize("family, layout", SGD_LAYOUTS)
def test_sgd_under_fsdp2_tp2_equals_one_process(family, layout, family_dirs, four_ranks):
    """Three SGD steps from init_from under FSDP2 x TP2, with sequence parallel, and (a mixture of experts)
    FSDP2 over 4, reach the losses and weights of one process that accumulates the data-parallel ranks' shares:
    every gradient is reduced where it must be (Qwen3's per-head q/k norms, replicated over tp; GPT-2's position
    table, whose output SP splits along the sequence; a router's loss, computed per rank as transformers does)."""
    path, _ = family_dirs[family]
    recipe = recipe_from(path)
    model = build_training_model(recipe, model_config(recipe.model), torch.device("cpu")).model
    opt = torch.optim.SGD(model.parameters(), lr=_hf_ranks.SGD_LR)
    losses = []
    dp = _hf_ranks.LAYOUTS[layout]["distributed.data_parallel_size"]
    for batch in _hf_ranks.sgd_batches(VOCAB):
        loss = sum(model(rows[:, :-1], rows[:, 1:]) for rows in batch.chunk(dp)) / dp  # each rank's share
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    got = {}
    for rank in range(4):
        saved = torch.load(four_ranks / f"{family}-{layout}-hf-rank{rank}.pt")
        assert saved["sgd_losses"] == pytest.approx(losses, rel=1e-5), rank
        got.update(saved["sgd_params"])
    worst = max((got[n] - p.detach()).abs().max().item() for n, p in model.named_parameters())
    assert worst <= 1e-5, worst


def test_tokenizer_json_encodes_like_autotokenizer(family_dir):
    """Every family's tokenizer class (transformers 5 builds Qwen2Tokenizer for a qwen2 directory, which rebuilds
    its own pre-tokenizer) encodes as canntrain does; a directory where they disagree is refused (bad input
    prepare_tokenizer_disagrees_with_transformers)."""
    path, _ = family_dir
    config = model_config(recipe_from(path).model)
    ours = pretrained_tokenizer(str(path), config)["tokenizer"]
    theirs = AutoTokenizer.from_pretrained(path)
    text = "def main(argv):\n    return {'a': [1, 2.5]}  # ünïcode 12345 東京\r\n"
    assert ours.tokenizer.encode(text, add_special_tokens=False).ids == theirs.encode(text, add_special_tokens=False)
    assert ours.eos_id == theirs.eos_token_id == 0


@pytest.mark.parametrize("preset", ["tiny-qwen2", "tiny"])
def test_a_tokenizer_trained_here_survives_export_as_the_model_types_tokenizer(preset, tmp_path, fast_recipe):
    """A fresh run's tokenizer is trained with the pre-tokenizer transformers imposes on its model type (Qwen2's
    regex and NFC), so that AutoTokenizer on the export gives the ids it trained on."""
    trainer = Trainer(fast_recipe(**{"model.preset": preset, "optim.max_steps": 1}), run_dir=tmp_path / "run")
    trainer.fit()
    out = export_hf(tmp_path / "run", tmp_path / "hf").out
    text = "x = 12345  # cafe\u0301\r\n\tdone"
    assert AutoTokenizer.from_pretrained(out).encode(text, add_special_tokens=False) == trainer.data.encode(text)


def test_train_from_hf_then_export_loads_with_transformers(family_dir, tmp_path, data_cache, capsys):
    path, hf = family_dir
    trainer = Trainer(recipe_from(path, data_cache), run_dir=tmp_path / "run", progress=False)
    assert f"tokenizer: {path / 'tokenizer.json'} (data.tokenizer's training settings" in capsys.readouterr().out
    assert trainer.data.info["tokenizer_source"] == "given" and trainer.data.vocab_size == VOCAB
    trainer.fit()
    out = tmp_path / "exported"
    assert main(["export", str(tmp_path / "run"), "-o", str(out), "--max-shard-size", "300KB"]) == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"} <= set(os.listdir(out))
    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert type(loaded) is type(hf)  # the family's own class (Qwen2ForCausalLM, ...)
    with torch.no_grad():
        assert (loaded(IDS).logits - trainer.model(IDS)).abs().max() <= LOGITS_TOL
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.encode("x = 1\n", add_special_tokens=False) == trainer.data.encode("x = 1\n")
    # canntrain generate reads the export (the family's file names and layouts) and the run alike, and decodes
    # what transformers' greedy generate does
    prompts = ["def f(x):\n", "import os"]
    from_export = load_generator(out, "cpu").generate(prompts, max_new_tokens=8)
    from_run = load_generator(tmp_path / "run", "cpu").generate(prompts, max_new_tokens=8)
    assert [c.ids for c in from_export] == [c.ids for c in from_run]
    for c in from_export:
        theirs = loaded.generate(torch.tensor([c.prompt_ids]), do_sample=False, max_new_tokens=8, pad_token_id=0)
        n = len(c.ids)  # ours stops after an end token
        assert theirs[0, len(c.prompt_ids) :][:n].tolist() == c.ids, (family_dir, c.prompt)
    # never overwritten
    assert main(["export", str(tmp_path / "run"), "-o", str(out)]) == 2
    assert "already exists and is not empty" in capsys.readouterr().err


def _tensor_names(d: Path) -> set[str]:
    from canntrain_core.models.hf import weight_files

    return set(weight_files(d))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_tied_model_from_hf_trains_tied_and_exports_what_it_trained(family, tmp_path, data_cache):
    """A directory without lm_head.weight (tie_word_embeddings, as Llama 3.2 1B and Qwen2.5/Qwen3's small sizes
    are written) loads; the head stays the embedding through training; the export has no lm_head.weight either
    and gives the trained model's logits."""
    src = tmp_path / "tied"
    hf = write_hf_model(src, tie=True, family=family)
    assert "lm_head.weight" not in _tensor_names(src)
    trainer = Trainer(recipe_from(src, data_cache), run_dir=tmp_path / "run", progress=False)
    model = trainer.model
    assert model.lm_head.weight is model.model.embed_tokens.weight
    with torch.no_grad():
        assert (model(IDS) - hf(IDS).logits).abs().max() <= LOGITS_TOL
    trainer.fit()
    assert model.lm_head.weight is model.model.embed_tokens.weight  # one tensor, one optimizer state
    assert main(["export", str(tmp_path / "run"), "-o", str(tmp_path / "out")]) == 0
    assert "lm_head.weight" not in _tensor_names(tmp_path / "out")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert loaded.config.tie_word_embeddings and loaded.lm_head.weight is loaded.get_input_embeddings().weight
    model.eval()
    with torch.no_grad():
        assert (loaded(IDS).logits - model(IDS)).abs().max() <= LOGITS_TOL


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_fresh_tied_run_exports_what_it_trained(family, tmp_path, fast_recipe):
    """Pretraining each family's tiny preset, tied: the export loads in transformers as the family's class."""
    recipe = fast_recipe(
        **{"model.preset": FAMILIES[family].tiny, "model.overrides.tie_word_embeddings": True, "optim.max_steps": 4}
    )
    trainer = Trainer(recipe, run_dir=tmp_path / "run", progress=False)
    trainer.fit()
    model = trainer.model.eval()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert main(["export", str(tmp_path / "run"), "-o", str(tmp_path / "out")]) == 0
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert type(loaded).__name__ == FAMILIES[family].causal_lm_class
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (loaded(ids).logits - model(ids)).abs().max() <= LOGITS_TOL


def test_tied_embeddings_under_pipeline_parallel_are_refused(fast_recipe):
    from canntrain_core.errors import RecipeError
    from canntrain_core.sizing.layout import check_layout

    recipe = fast_recipe(
        **{
            "model.overrides.tie_word_embeddings": True,
            "distributed.world_size": 2,
            "distributed.pipeline_parallel_size": 2,
            "optim.grad_accum_steps": 2,
        }
    )
    with pytest.raises(RecipeError, match="tie_word_embeddings cannot be split by pipeline_parallel_size"):
        check_layout(recipe, model_config(recipe.model, 512))


def _rewrite_shard_with_wrong_shape(d: Path) -> str:
    index = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
    name = "model.layers.1.mlp.up_proj.weight"
    from safetensors.torch import load_file

    tensors = load_file(d / index[name])
    tensors[name] = torch.zeros(10, 10)
    save_file(tensors, d / index[name], metadata={"format": "pt"})
    return f"{name} in {index[name]}: shape [10, 10], the model needs [384, 128]"


def _remove_a_shard(d: Path) -> str:
    shard = sorted(d.glob("model-*.safetensors"))[1]
    shard.unlink()
    return f"lists {shard.name}, which is missing"


def _garble_a_header(d: Path) -> str:
    shard = sorted(d.glob("model-*.safetensors"))[2]
    shard.write_bytes(b"\xff" * 64)
    return f"{shard}: not a safetensors file"


@pytest.mark.parametrize(
    "damage",
    [_rewrite_shard_with_wrong_shape, _remove_a_shard, _garble_a_header],
    ids=["wrong-shape", "missing-shard", "bad-header"],
)
def test_a_damaged_hf_directory_is_named(tmp_path, damage):
    write_hf_model(tmp_path)
    fragment = damage(tmp_path)
    recipe = recipe_from(tmp_path)
    with pytest.raises(BadInput) as e:
        build_training_model(recipe, model_config(recipe.model), torch.device("cpu"))
    assert fragment in str(e.value)


def test_a_recipe_that_contradicts_config_json_is_named(hf_dir, tmp_path, capfd):
    path, _ = hf_dir
    with pytest.raises(BadInput, match=r"model\.overrides\.num_hidden_layers=8.*config\.json has 4"):
        model_config(recipe_from(path, **{"model.overrides.num_hidden_layers": 8}).model)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model:\n  preset: llama2-7b\n  init_from: {path}\n")
    assert main(["train", str(recipe), "--run-dir", str(tmp_path / "run")]) == 2
    err = capfd.readouterr().err
    assert "model.preset sets hidden_size=4096" in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()


def test_a_tokenizer_larger_than_the_model_vocabulary_is_refused(tmp_path, data_cache):
    write_hf_model(tmp_path, vocab=280, tokenizer_vocab=VOCAB)
    recipe = recipe_from(tmp_path, data_cache)
    config = model_config(recipe.model)
    with pytest.raises(BadInput, match=r"tokenizer.json: the tokenizer has 3\d\d tokens, more than the model's 280"):
        build_data(recipe.data, seed=0, **pretrained_tokenizer(recipe.model.init_from, config))
