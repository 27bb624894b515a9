"""Which parallel layouts canntrain runs, and why the others are refused: the one validator.

Called by the recipe loader (what it can check without a model), the trainer (with the model and the
node size), the planner (it ranks only layouts this accepts) and the estimator (it says when the
trainer would refuse what it estimates). Every message names the recipe key to change.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from canntrain_core.errors import RecipeError
from canntrain_core.sizing.shapes import ModelShape, shape_of


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1
    zero: int = 0
    sequence_parallel: bool = False
    vocab_parallel: bool = False  # with tp > 1: embedding, head and loss split over the vocabulary
    microbatches: int = 1  # per optimizer step: what a pipeline schedule splits the batch into
    pipeline_schedule: str = "1f1b"
    offload_optimizer: bool = False
    precision: str = "fp32"
    packing: bool = False  # packed instruction rows carry a block-diagonal mask
    lora: bool = False
    seq_length: int = 0  # tokens per row (0: not known here)
    step_rows: int = 0  # rows a rank feeds a pipeline schedule per optimizer step (0: not known here)

    @classmethod
    def from_recipe(cls, recipe: Any) -> "Layout":
        d = recipe.distributed
        return cls(
            tp=d.tensor_parallel_size,
            pp=d.pipeline_parallel_size,
            dp=d.data_parallel_size,
            cp=d.context_parallel_size,
            ep=d.expert_parallel_size,
            zero=d.zero_optimization,
            sequence_parallel=d.sequence_parallel,
            vocab_parallel=d.tensor_parallel_size > 1 and d.vocab_parallel,
            microbatches=d.num_microbatches or recipe.optim.grad_accum_steps,
            pipeline_schedule=d.pipeline_schedule,
            offload_optimizer=recipe.optim.offload_optimizer,
            precision=recipe.model.precision,
            packing=recipe.data.packing,  # an SFT key: the schema refuses it elsewhere
            lora=recipe.lora.enabled,
            seq_length=recipe.data.seq_length,
            step_rows=recipe.data.batch_size * recipe.optim.grad_accum_steps,
        )

    @classmethod
    def from_setup(cls, s: Any) -> "Layout":
        """From a sizing.setup.TrainSetup (the estimator's and the planner's description)."""
        return cls(
            tp=s.tp,
            pp=s.pp,
            dp=s.dp,
            cp=s.cp,
            ep=s.ep,
            zero=s.zero,
            sequence_parallel=s.tp > 1 and s.sequence_parallel,
            vocab_parallel=s.tp > 1 and s.vocab_parallel,
            microbatches=s.microbatches,
            pipeline_schedule=s.pipeline_schedule,
            offload_optimizer=s.offload_optimizer,
            precision=s.precision,
            seq_length=s.seq_length,
        )

    @property
    def world_size(self) -> int:
        """Processes of the trained model: tp x pp x dp x cp (expert parallel borrows from dp x cp)."""
        return self.tp * self.pp * self.dp * self.cp

    def size_problem(self, world_size: int | None = None) -> str | None:
        """Why these sizes do not multiply up (to ``world_size``, when given), or None."""
        if world_size is not None and self.world_size != world_size:
            return (
                f"world_size={world_size} but tensor_parallel_size({self.tp}) x pipeline_parallel_size({self.pp}) x "
                f"data_parallel_size({self.dp}) x context_parallel_size({self.cp}) = {self.world_size}"
            )
        if (self.dp * self.cp) % self.ep:
            return (
                f"expert_parallel_size={self.ep} must divide data_parallel_size x context_parallel_size = "
                f"{self.dp * self.cp}"
            )
        return None

    @property
    def fsdp(self) -> bool:
        """Data parallel by FSDP2 (zero_optimization 1-3 over more than one rank)."""
        return self.zero > 0 and self.dp > 1

    @property
    def dp_shard(self) -> int:
        """Data-parallel ranks that shard the model (FSDP2), as runtime.distributed.ParallelDims counts them."""
        return self.dp if self.zero > 0 else 1


def layout_problems(
    layout: Layout, model: Any = None, devices_per_node: int | None = None, allow_cross_node_tp: bool = False
) -> list[str]:
    """Why the trainer cannot run ``layout`` (empty: it can).

    ``model``: a sizing.shapes.ModelShape (heads, layers, ...); without it only the model-free rules
    apply. ``devices_per_node``: without it, TP's placement is not checked.
    """
    L = layout
    out = []
    if L.sequence_parallel and L.pp > 1:
        out.append(
            "distributed.sequence_parallel with pipeline_parallel_size > 1 is not supported yet "
            "(stage boundaries would carry sequence shards)"
        )
    if L.cp > 1:
        out += _context_parallel_problems(L)
    if L.zero == 0 and L.dp > 1 and (L.tp > 1 or L.pp > 1):
        out.append(
            "distributed.zero_optimization=0 (DDP) with tensor or pipeline parallel is not supported; "
            "use zero_optimization >= 1 (FSDP2)"
        )
    if L.pp > 1 and L.microbatches < L.pp:
        out.append(
            f"pipeline_parallel_size={L.pp} needs at least {L.pp} micro-batches per step, got "
            f"{L.microbatches} (raise optim.grad_accum_steps or distributed.num_microbatches)"
        )
    if L.pp > 1 and L.step_rows and L.step_rows % L.microbatches:
        out.append(
            f"distributed.num_microbatches={L.microbatches} does not divide the {L.step_rows} rows a pipeline step "
            "splits (data.batch_size x optim.grad_accum_steps): every micro-batch must hold as many rows"
        )
    if L.pp > 1 and L.precision == "fp16":
        out.append("model.precision=fp16 with pipeline parallel is not supported; use bf16")
    if L.packing and L.pp > 1:
        out.append(
            "data.packing with pipeline_parallel_size > 1 is not supported: a stage receives hidden states "
            "only, not the samples' positions and mask (train unpacked, or without pipeline parallel)"
        )
    if L.lora and (L.tp > 1 or L.pp > 1):
        out.append(
            "lora.enabled with tensor or pipeline parallel is not supported yet (peft's layers wrap the "
            "projections the TP plan shards); use FSDP2 (zero_optimization >= 1) or one device"
        )
    if L.offload_optimizer and not L.fsdp:
        out.append(
            "optim.offload_optimizer needs FSDP2 (distributed.zero_optimization >= 1 and "
            "data_parallel_size > 1): its CPUOffloadPolicy is what offloads; DDP and one rank cannot"
        )
    if model is not None and model.tie_embeddings and not model.scalar_head and L.pp > 1:
        out.append(
            "a model with tie_word_embeddings cannot be split by pipeline_parallel_size > 1: the first "
            "stage holds the embedding and the last the head, which must stay one tensor "
            "(set model.overrides.tie_word_embeddings=false, or train without pipeline parallel)"
        )
    if model is not None and L.seq_length > model.max_positions:
        what = "learned position table" if model.kind == "gpt" else "max_position_embeddings"
        out.append(
            f"data.seq_length={L.seq_length} is longer than the model's {model.max_positions} positions ({what}): "
            "lower data.seq_length, or raise the model's positions (model.overrides) where its position encoding "
            "allows it"
        )
    if model is not None:
        split = [("attention heads", model.num_heads), ("KV heads", model.num_kv_heads)]
        if model.kind != "moe":  # a mixture of experts' MLP is not split over tp (parallel/tp.py)
            split.append(("intermediate_size", model.intermediate_size))
        for attr, n in split:
            if n % L.tp:
                out.append(f"distributed.tensor_parallel_size={L.tp} must divide the model's {n} {attr}")
        if L.vocab_parallel and model.vocab_size % L.tp:
            out.append(
                f"distributed.vocab_parallel: tensor_parallel_size={L.tp} must divide the vocabulary of "
                f"{model.vocab_size} entries (set distributed.vocab_parallel=false, or a vocabulary size it divides)"
            )
        if L.cp > 1 and model.kind in ("moe", "gpt"):
            why = {
                "moe": "a mixture of experts (its router balance is counted per data-parallel rank)",
                "gpt": "GPT-2 (its attention calls SDPA itself)",
            }[model.kind]
            out.append(
                f"distributed.context_parallel_size > 1 is not built for {why} yet; llama, qwen and mistral run it"
            )
        if model.kind == "moe" and L.pp > 1:
            out.append(
                "pipeline_parallel_size > 1 is not built for a mixture of experts yet (a pipeline stage's router "
                "loss would not reach the schedule's loss); use expert parallelism and FSDP2 over data-parallel ranks"
            )
        if model.kind == "gpt" and L.lora:
            out.append(
                "lora.enabled is not built for GPT-2 (peft's GPT-2 adapters wrap the fused c_attn, canntrain "
                "trains q, k and v apart); fine-tune it in full"
            )
        if L.pp > model.num_layers:
            out.append(f"distributed.pipeline_parallel_size={L.pp} exceeds the model's {model.num_layers} layers")
        experts = getattr(model, "num_experts", 1)
        if L.ep > 1 and (experts <= 1 or experts % L.ep):
            out.append(f"distributed.expert_parallel_size={L.ep} must divide the model's {experts} expert(s)")
        elif L.ep > 1 and L.zero == 0:
            out.append(
                "distributed.expert_parallel_size > 1 needs zero_optimization >= 1: expert parallel borrows its "
                "ranks from FSDP2's data-parallel ranks"
            )
    if devices_per_node and L.tp > 1 and devices_per_node % L.tp and not allow_cross_node_tp:
        out.append(
            f"distributed.tensor_parallel_size={L.tp} spans nodes of {devices_per_node} devices; "
            "TP's all-reduces need the intra-node links (set distributed.allow_cross_node_tp to force)"
        )
    return out


def context_parallel_pays(seq_length: int, cp: int) -> bool:
    """Whether rows are long enough to split over ``cp`` ranks (4k tokens a rank or more): what the planner searches
    and the out-of-memory hint suggests (the validator then keeps the splits the trainer runs). Shorter rows fit by
    other means, and each ring step would be too short to hide its K/V exchange."""
    return cp == 1 or seq_length >= 4096 * cp


def _context_parallel_problems(L: Layout) -> list[str]:
    """What context parallelism runs with: FSDP2 over dp x cp, whole rows cut in 2 x cp chunks (parallel/context.py),
    TP with or without sequence parallel, pipeline parallel (whose unpacked rows give every stage its positions);
    not yet expert parallel."""
    out = []
    key = f"distributed.context_parallel_size={L.cp}"
    if L.zero == 0:
        out.append(
            f"{key} needs zero_optimization >= 1: FSDP2 averages the gradients over the cp ranks with the "
            "data-parallel ones"
        )
    if L.seq_length and L.seq_length % (2 * L.cp):
        out.append(
            f"{key} cuts each row into 2 x {L.cp} chunks: data.seq_length={L.seq_length} must be a multiple "
            f"of {2 * L.cp}"
        )
    if L.ep > 1:
        out.append(f"{key} with distributed.expert_parallel_size > 1 is not supported yet")
    return out


def check_layout(recipe: Any, model: Any = None, devices_per_node: int | None = None) -> None:
    """Raise a RecipeError listing every problem of the recipe's layout (``model``: a ModelShape or a
    transformers config)."""
    if model is not None and not isinstance(model, ModelShape):
        model = shape_of(model)
    problems = layout_problems(recipe.layout, model, devices_per_node, recipe.distributed.allow_cross_node_tp)
    if problems:
        raise RecipeError("invalid parallel layout:\n  " + "\n  ".join(problems))
