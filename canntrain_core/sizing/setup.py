"""How a model is trained, as far as memory is concerned: precision, batch, parallel layout.

:class:`TrainSetup` is built from a recipe (:func:`setup_from_recipe`) or by hand (the model's shape, the other
half of an estimate, comes from ``memory.recipe_shape.shape_from_recipe`` or ``sizing.shapes``). Built from a
recipe, it carries the recipe's sequence parallel, LoRA and offload settings; built by hand, its defaults are the
recipe's (sequence parallel off, vocabulary parallel on) and what
canntrain's trainer does (flash attention, the optimizer's foreach mode), and the planner varies the rest.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any, Literal

from canntrain_core.sizing.layout import Layout

Recompute = Literal["none", "selective", "full"]
RECOMPUTE_LEVELS: tuple[str, ...] = ("none", "selective", "full")


@dataclass(frozen=True)
class LoraSetup:
    """LoRA adapters of rank ``rank`` on the named block matrices; the base weights are frozen."""

    rank: int = 16
    targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    dropout: float = 0.05  # on the adapters' input (peft's lora_dropout): a mask and a copy of it kept for backward
    base_bits: int = 16  # 4: QLoRA's NF4 block linears (lora.load_in_4bit; the rest of the base 16-bit)


NF4_BLOCK = 64  # weights per 8-bit absmax scale (bitsandbytes' default)
DOUBLE_QUANT_BLOCK = 256  # absmax scales per fp32 scale of the second quantization


def nf4_bytes(elements: int) -> int:
    """Bytes of ``elements`` weights in NF4 with double quantization (the QLoRA paper's, bitsandbytes'): half a byte
    each, one 8-bit scale per 64 and one fp32 scale per 256 of those."""
    return elements // 2 + elements // NF4_BLOCK + 4 * elements // (NF4_BLOCK * DOUBLE_QUANT_BLOCK)


@dataclass(frozen=True)
class TrainSetup:
    """Per-rank training layout. Sizes follow recipe ``distributed.*`` keys (dp = data_parallel_size)."""

    precision: Literal["bf16", "fp16", "fp32"] = "bf16"
    micro_batch: int = 1
    seq_length: int = 4096
    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1
    zero: int = 0  # 0 none, 1 optimizer states, 2 + gradients, 3 + parameters (FSDP)
    recompute: Recompute = "none"
    offload_optimizer: bool = False
    grad_accum: int = 1
    num_microbatches: int | None = None  # pipeline micro-batches per step; None: grad_accum
    pipeline_schedule: Literal["1f1b", "gpipe"] = "1f1b"
    sequence_parallel: bool = False  # with tp > 1, norms/residuals split over tp as well (the recipe's default: off)
    vocab_parallel: bool = True  # with tp > 1, embedding and output projection split over tp too
    flash_attention: bool = True  # no a*s^2 score matrix kept (sdpa / FlashAttention)
    # "amp": fp32 weights, autocast casts to bf16/fp16 per op (what canntrain's trainer does).
    # "half": weights and grads in bf16/fp16, fp32 master copy inside the optimizer (Megatron/DeepSpeed).
    weights: Literal["amp", "half"] = "amp"
    optimizer_foreach: bool = False
    lora: LoraSetup | None = None

    def __post_init__(self) -> None:
        for name in ("micro_batch", "seq_length", "tp", "pp", "dp", "cp", "ep", "grad_accum"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1 (got {getattr(self, name)})")
        if self.zero not in (0, 1, 2, 3):
            raise ValueError(f"zero_optimization must be 0, 1, 2 or 3 (got {self.zero})")
        if self.recompute not in RECOMPUTE_LEVELS:
            raise ValueError(f"activation_checkpointing must be one of {RECOMPUTE_LEVELS} (got {self.recompute!r})")
        if self.precision not in ("bf16", "fp16", "fp32"):
            raise ValueError(f"precision must be bf16, fp16 or fp32 (got {self.precision!r})")
        if self.weights not in ("amp", "half"):
            raise ValueError(f"weights must be 'amp' or 'half' (got {self.weights!r})")
        if self.lora is not None and self.lora.base_bits == 4 and (self.precision == "fp32" or self.world_size > 1):
            raise ValueError("a 4-bit LoRA base computes in bf16 or fp16 on one device")
        problem = self.layout.size_problem()
        if problem:
            raise ValueError(problem)

    @property
    def layout(self) -> Layout:
        """The parallel layout of this setup (what the validator checks and the mesh is built from)."""
        return Layout.from_setup(self)

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def weights_16bit(self) -> bool:
        """Whether the weights the forward reads are stored in 16 bits (no autocast copy, a 16-bit residual
        stream): ``weights="half"``, or a LoRA base under bf16/fp16, which the trainer holds in 16 bits (it is
        frozen: ``models.lifecycle.hold_frozen_in_16_bits``)."""
        return self.precision != "fp32" and (self.weights == "half" or self.lora is not None)

    @property
    def fsdp(self) -> bool:
        """Data parallel by FSDP2: ZeRO 1-3 over more than one data (and context) parallel rank."""
        return self.zero >= 1 and self.dp * self.cp > 1

    @property
    def fsdp_mixed_precision(self) -> bool:
        """FSDP2's 16-bit MixedPrecisionPolicy: gathered weights and a layer's inputs in 16 bits."""
        return self.fsdp and self.precision != "fp32"

    @property
    def microbatches(self) -> int:
        """Micro-batches per optimizer step (what the pipeline schedule sees)."""
        return self.num_microbatches or self.grad_accum

    def but(self, **changes: Any) -> "TrainSetup":
        """A copy with some fields changed (validated again)."""
        return replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def setup_from_recipe(recipe: Any, **extra: Any) -> TrainSetup:
    """The TrainSetup of a validated :class:`canntrain_core.recipe.Recipe`; ``extra`` sets the other knobs.
    The parallel sizes are the recipe's :class:`~canntrain_core.sizing.layout.Layout`."""
    m, L = recipe.model, recipe.layout
    fields: dict[str, Any] = dict(
        precision=m.precision,
        micro_batch=recipe.data.batch_size,
        seq_length=recipe.data.seq_length,
        tp=L.tp,
        pp=L.pp,
        dp=L.dp,
        cp=L.cp,
        ep=L.ep,
        zero=L.zero,
        recompute=m.activation_checkpointing,
        offload_optimizer=L.offload_optimizer,
        grad_accum=recipe.optim.grad_accum_steps,
        num_microbatches=L.microbatches,
        pipeline_schedule=L.pipeline_schedule,
        # What the trainer does: SP and vocabulary parallel as the recipe says.
        sequence_parallel=L.sequence_parallel,
        vocab_parallel=L.vocab_parallel,
        lora=LoraSetup(
            recipe.lora.rank,
            tuple(recipe.lora.target_modules),
            recipe.lora.dropout,
            4 if recipe.lora.load_in_4bit else 16,
        )
        if recipe.lora.enabled
        else None,
    )
    fields.update(extra)
    return TrainSetup(**fields)
