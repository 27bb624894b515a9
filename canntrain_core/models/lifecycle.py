"""From a recipe to the right bytes on each device: the one sequence every trainer, notebook and
benchmark builds a model for training through.

1. build the family's transformers model (``canntrain_core/families/``) on the ``meta`` device (shapes
   only: any size, no memory);
2. route it through the recipe's kernels and wrap it as a CausalLM (the loss inside the root module);
3. ``parallelize``: pipeline split, tensor parallel, recompute, compile, FSDP2 / DDP, still on meta;
   A weight that never trains (a LoRA base, a reference or reward model) is held in the recipe's 16-bit
   dtype from here on (:func:`hold_frozen_in_16_bits`), so it is sharded, stored and computed in 16 bits;
4. ``to_empty`` on the target device: each rank allocates only the shards it holds; a tied output
   head (``tie_word_embeddings``) is tied back to the embedding (``to_empty`` gives each module a
   tensor of its own), so the two stay one parameter through training, checkpoints and export;
5. fill them: ``model.init_from``'s safetensors (each rank reads its own slices), or the seeded,
   layout-independent initialisation of ``models.init``; recompute the RoPE buffers.

So a rank's memory never holds more than its own shards plus one full parameter, whatever the size
of the model (``benchmarks/setup_memory.py`` measures it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from canntrain_core.models.classes import training_class
from canntrain_core.models.fused import apply_kernels, loss_cross_entropy, ring_block_kernel
from canntrain_core.models.hf import load_weights
from canntrain_core.models.init import init_weights, reset_buffers
from canntrain_core.models.lm import CausalLM
from canntrain_core.models.lora import apply_lora, has_adapters, is_adapter
from canntrain_core.models.quantize import quantize_base_4bit
from canntrain_core.parallel import parallelize
from canntrain_core.runtime.accelerator import HALF_DTYPES
from canntrain_core.runtime.distributed import ParallelDims
from canntrain_kernels.reference import plain_cross_entropy


@dataclass
class BuiltModel:
    model: CausalLM
    config: Any  # the family's transformers config
    schedule: Any  # the pipeline schedule under pipeline parallel, else None
    source: str  # where the weights came from, for the summary
    loaded: list[dict[str, Any]] = field(default_factory=list)  # init_from: this rank's tensors and slices
    # what else a stage's build made for it to hold, by attribute name (PPO: policy, critic, frozen, kl_coeff):
    # returned, not set on the trainer by the builder; the engine sets them after the build
    held: dict[str, Any] = field(default_factory=dict)


def build_meta_model(
    recipe, config, device: torch.device, mesh=None, dims=None, head: str = "lm", trainable: bool = True
):
    """Steps 1-3: the parallelized CausalLM on ``meta`` and its pipeline schedule (or None).

    ``mesh`` and ``dims`` come from ``runtime.distributed``; leave them out on one device. The memory
    measurement stops here and materializes under FakeTensorMode instead. ``head="scalar"``: the output
    projection has one row, a score per position (reward models and PPO's critic).
    """
    m = recipe.model
    dims = dims or ParallelDims.from_recipe(recipe)
    with torch.device("meta"):
        hf_model = training_class(config)(config)
    if recipe.lora.enabled:
        apply_lora(hf_model, recipe.lora)
    cross_entropy = plain_cross_entropy
    if m.kernels != "eager" or m.kernel_overrides:
        apply_kernels(hf_model, m, device=device.type)
        cross_entropy = loss_cross_entropy(m, device=device.type)
    # else kernels: eager keeps transformers' own modules and the plain loss (the registry's
    # eager ops compute the same; its eager cross_entropy is the chunked one, slower on CPU).
    model = CausalLM(hf_model, cross_entropy)
    if head == "scalar":
        with torch.device("meta"):
            model.lm_head = torch.nn.Linear(config.hidden_size, 1, bias=False)
    if not trainable:
        model.requires_grad_(False)
    hold_frozen_in_16_bits(model, m.precision)
    ring_block = ring_block_kernel(m, device.type) if dims.cp > 1 else None
    schedule = parallelize(model, mesh, dims, recipe, device, trainable, ring_block)
    return model, schedule


def hold_frozen_in_16_bits(model: torch.nn.Module, precision: str) -> int:
    """Cast every parameter that does not train to ``precision``'s 16-bit dtype (bf16, fp16; fp32 changes
    nothing); returns how many elements were cast.

    A frozen weight needs no fp32 master (no optimizer updates it) and, already 16-bit, no copy made by autocast
    for each matmul: a 7B LoRA base holds 2 bytes per parameter instead of 4 + 2, as peft, torchtune and
    LLaMA-Factory users load it. What trains (adapters, a scalar head) stays fp32 with fp32 AdamW states, and the
    forward runs under autocast as before. Done on ``meta``, before sharding, so FSDP2 and TP shard 16-bit
    tensors."""
    dtype = HALF_DTYPES.get(precision)
    if dtype is None:
        return 0
    cast = 0
    for p in model.parameters():
        if not p.requires_grad and p.dtype != dtype:
            p.data = p.data.to(dtype)
            cast += p.numel()
    return cast


def tie_head(model: CausalLM, config) -> None:
    """Make the output head use the embedding's parameter when the config ties them.

    ``to_empty`` materializes each module's parameters on its own, so a tie made on ``meta`` is lost
    for plain tensors (one process, or TP's replicated embedding); FSDP2's DTensors are swapped in place
    and keep it. Pipeline stages hold either the embedding or the head, never both: the layout
    validator refuses tied embeddings under pipeline parallel.
    """
    embed = model.model.embed_tokens
    if config.tie_word_embeddings and embed is not None and model.lm_head is not None:
        model.lm_head.weight = embed.weight


def build_training_model(
    recipe,
    config,
    device: torch.device,
    mesh=None,
    dims=None,
    fill: bool = True,
    head: str = "lm",
    trainable: bool = True,
) -> BuiltModel:
    """Steps 1-5 above for ``recipe`` (its model, distributed and seed) on ``device``.

    ``fill=False`` skips step 5's weights (a resumed run loads every one of them from its checkpoint;
    a model with LoRA adapters fills its base from ``model.init_from`` regardless: its checkpoints hold
    the adapters only).
    """
    m = recipe.model
    model, schedule = build_meta_model(recipe, config, device, mesh, dims, head, trainable)
    model.to_empty(device=device)
    if head == "lm":
        tie_head(model, config)
    fresh = is_adapter if head == "lm" else lambda n: is_adapter(n) or n.endswith("lm_head.weight")  # not in init_from
    loaded: list[dict[str, Any]] = []
    if not fill and not has_adapters(model):  # an adapted model's checkpoints hold its adapters only
        source = "weights from the checkpoint it resumes"
    elif m.init_from:
        loaded = load_weights(model, m.init_from, skip=fresh)
        init_weights(model, config, recipe.experiment.seed, only=fresh)  # LoRA adapters, a scalar head
        source = f"weights from {m.init_from}"
    else:
        init_weights(model, config, recipe.experiment.seed)
        source = f"initialised from seed {recipe.experiment.seed}"
    reset_buffers(model, config, device)
    if recipe.lora.enabled and recipe.lora.load_in_4bit:  # QLoRA: the 16-bit base's block linears to NF4
        quantize_base_4bit(model, HALF_DTYPES[m.precision], device)
        source += ", the block linear layers quantized to 4-bit NF4"
    return BuiltModel(model, config, schedule, source, loaded)


def build_frozen_model(
    recipe, config, device: torch.device, mesh=None, dims=None, fill: bool = True, head: str = "lm"
) -> CausalLM:
    """A model that only runs (DPO's and GRPO's reference, PPO's reference and reward model): laid out as the
    trained one, without gradients, in the recipe's 16-bit precision when it has one, in eval mode; ``fill`` and
    ``head`` as for :func:`build_training_model`."""
    return build_training_model(recipe, config, device, mesh, dims, fill, head, trainable=False).model.eval()
