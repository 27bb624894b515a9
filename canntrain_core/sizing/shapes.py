"""Model shapes the memory estimator works on: llama (GQA aware), gpt and MoE.

Every family of ``canntrain_core/families/`` has a shape (its ``shape_kind``: GPT-2's is gpt); the shapes
the estimator and the plan search cover without model code (GPT-3's sizes) live here, in
:data:`EXTRA_SHAPES`. A :class:`ModelShape` is all the estimator needs: no weights, no torch.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from types import SimpleNamespace
from typing import Any, Literal

from canntrain_core.families import FAMILIES, PRESET_FAMILY, Family, family_of
from canntrain_core.sizing.presets import PRESETS, preset_fields

ModelKind = Literal["llama", "gpt", "moe"]
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
ROUTED_EXPERT = ("gate_proj", "up_proj", "down_proj")  # in a mixture of experts: each routed expert's matrices


@dataclass(frozen=True)
class ModelShape:
    """Sizes of a decoder-only transformer.

    llama: RMSNorm, RoPE, SwiGLU MLP (gate, up, down), grouped-query attention, no biases.
    gpt: LayerNorm (weight+bias), learned positions, GELU MLP (fc, proj), biases, tied embeddings.
    moe: a llama block whose MLP is ``num_experts`` SwiGLU experts of ``intermediate_size`` with a
    router, ``experts_per_token`` of them active per token, and a shared expert of ``shared_expert_size``
    (0: none) that every token goes through, scaled by a one-output sigmoid gate (Qwen2-MoE).
    """

    kind: ModelKind
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    tie_embeddings: bool = False
    num_experts: int = 1
    experts_per_token: int = 1
    max_positions: int = 4096
    scalar_head: bool = False  # a reward model's or critic's one-row output projection instead of the vocabulary
    family: str = "llama"  # canntrain_core/families/: the model code that builds it (llama kind)
    explicit_head_dim: int = 0  # config.head_dim when it is not hidden / heads (Qwen3's small sizes); 0: derived
    qkv_bias: bool = False  # biases on the q, k and v projections (Qwen2)
    o_bias: bool = False  # a bias on the output projection
    qk_norm: bool = False  # an RMSNorm over each head's query and key (Qwen3)
    shared_expert_size: int = 0  # MoE: the shared expert's intermediate size (Qwen2-MoE); 0: none

    def __post_init__(self) -> None:
        for name in ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "vocab_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"model shape: {name} must be > 0 (got {getattr(self, name)})")
        if not self.explicit_head_dim and self.hidden_size % self.num_heads:
            raise ValueError(f"model shape: hidden_size {self.hidden_size} not divisible by num_heads {self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"model shape: num_heads {self.num_heads} not divisible by num_kv_heads {self.num_kv_heads}"
            )
        if self.kind == "moe" and not 1 <= self.experts_per_token <= self.num_experts:
            raise ValueError("model shape: experts_per_token must be in [1, num_experts]")

    @property
    def head_dim(self) -> int:
        return self.explicit_head_dim or self.hidden_size // self.num_heads

    @property
    def q_size(self) -> int:
        """Width of the q projection (and the input of o): num_heads x head_dim."""
        return self.num_heads * self.head_dim

    @property
    def out_rows(self) -> int:
        """Rows of the output projection: the vocabulary, or 1 for a scalar head."""
        return 1 if self.scalar_head else self.vocab_size

    def as_scalar_head(self) -> "ModelShape":
        """The same backbone with a one-row head (its own weight, never tied)."""
        return replace(self, scalar_head=True, tie_embeddings=False)

    @property
    def kv_size(self) -> int:
        """Width of the k (or v) projection: num_kv_heads x head_dim."""
        return self.num_kv_heads * self.head_dim

    def with_layers(self, n: int) -> "ModelShape":
        return replace(self, num_layers=n)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    # ------------------------------------------------------------------ parameters
    def layer_matrices(self) -> list[tuple[str, int, int]]:
        """(name, out, in) of every weight matrix of one block, in the order torch registers them."""
        h, i, kv, q = self.hidden_size, self.intermediate_size, self.kv_size, self.q_size
        attn = [("q_proj", q, h), ("k_proj", kv, h), ("v_proj", kv, h), ("o_proj", h, q)]
        if self.kind == "gpt":
            return attn + [("fc", i, h), ("proj", h, i)]
        mlp = [("gate_proj", i, h), ("up_proj", i, h), ("down_proj", h, i)]
        if self.kind == "moe":
            se = self.shared_expert_size  # named apart from the routed experts' *_proj (what EP splits)
            shared = [
                ("shared_gate", se, h),
                ("shared_up", se, h),
                ("shared_down", h, se),
                ("shared_expert_gate", 1, h),
            ]
            return attn + [("router", self.num_experts, h)] + (shared if se else []) + mlp * self.num_experts
        return attn + mlp

    def local_matrices(self, ep: int = 1) -> list[tuple[str, int, int]]:
        """The block's matrices a rank gathers and computes with: of a mixture of experts' routed experts, its
        ``ep`` share (parallel/expert.py)."""
        matrices = self.layer_matrices()
        if self.kind != "moe":
            return matrices
        routed = [m for m in matrices if m[0] in ROUTED_EXPERT]
        return [m for m in matrices if m[0] not in ROUTED_EXPERT] + routed[: len(routed) // ep]

    def mlp_tp(self, tp: int) -> int:
        """How many ways tensor parallel splits the MLP: tp, or 1 for a mixture of experts (its block runs whole
        on every tp rank; parallel/tp.py)."""
        return 1 if self.kind == "moe" else tp

    def elements_per_rank(self, matrices: list[tuple[str, int, int]], tp: int) -> int:
        """Elements of ``matrices`` on one tp rank: attention's split over tp, the MLP's by ``mlp_tp``."""
        return sum(o * i // (tp if name in ATTENTION else self.mlp_tp(tp)) for name, o, i in matrices)

    def tp_replicated_params(self) -> int:
        """Parameters every tp rank holds whole (a mixture of experts' blocks; 0 for a dense model)."""
        if self.kind != "moe":
            return 0
        return self.num_layers * sum(o * i for name, o, i in self.layer_matrices() if name not in ATTENTION)

    def layer_vectors_split(self) -> tuple[int, int]:
        """Elements of one block's 1-D parameters as (replicated under TP, split over TP): norm weights (and
        Qwen3's per-head q/k norms) and row-parallel biases are whole on every rank; the biases of the
        column-parallel projections (q, k, v; gpt's fc) are split with their rows."""
        h, kv, q = self.hidden_size, self.kv_size, self.q_size
        if self.kind == "gpt":  # two LayerNorms (w+b), biases of o and proj; split: q, k, v and fc
            return 4 * h + 2 * h, (q + 2 * kv) + self.intermediate_size
        return 2 * h + h * self.o_bias + 2 * self.head_dim * self.qk_norm, (q + 2 * kv) * self.qkv_bias

    def layer_vectors(self) -> int:
        """Elements of one block's 1-D parameters (norm weights, biases)."""
        return sum(self.layer_vectors_split())

    def layer_params(self) -> int:
        return sum(o * i for _, o, i in self.layer_matrices()) + self.layer_vectors()

    def embedding_params(self) -> int:
        pos = self.max_positions * self.hidden_size if self.kind == "gpt" else 0
        return self.vocab_size * self.hidden_size + pos

    def head_params(self) -> int:
        """Final norm plus the output projection (zero extra when tied to the embedding)."""
        norm = 2 * self.hidden_size if self.kind == "gpt" else self.hidden_size
        return norm + (0 if self.tie_embeddings else self.out_rows * self.hidden_size)

    def num_params(self) -> int:
        return self.embedding_params() + self.num_layers * self.layer_params() + self.head_params()

    def flops_per_token(self, seq_length: int) -> float:
        """Training FLOPs per token (forward + backward), as torchtitan and PaLM's MFU count them:
        6 x the weights a token's matmuls use (the output projection too, not the embedding lookup;
        MoE: only the active experts) + 12 x layers x hidden x seq_length for attention's scores and
        values (no discount for the causal mask). The one definition: MFU, the planner's step time."""
        h, i = self.hidden_size, self.intermediate_size
        layer = sum(o * n for _, o, n in self.layer_matrices())
        if self.kind == "moe":
            layer -= (self.num_experts - self.experts_per_token) * 3 * h * i
        matmul = self.num_layers * layer + self.out_rows * h
        return 6.0 * matmul + 12.0 * self.num_layers * h * seq_length

    def expert_params(self) -> int:
        """Parameters of every layer's experts (0 for a dense model): what expert parallelism splits."""
        return (
            self.num_layers * self.num_experts * 3 * self.hidden_size * self.intermediate_size
            if self.kind == "moe"
            else 0
        )

    def active_params(self) -> int:
        """Parameters one token goes through (MoE: only experts_per_token experts)."""
        if self.kind != "moe":
            return self.num_params()
        return (
            self.num_params() - self.expert_params() * (self.num_experts - self.experts_per_token) // self.num_experts
        )


# Shapes without model code (public configs of GPT-3's sizes): the estimator and the planner only.
EXTRA_SHAPES: dict[str, ModelShape] = {
    "gpt3-1.3b": ModelShape("gpt", 2048, 8192, 24, 16, 16, 50257, tie_embeddings=True, max_positions=2048),
    "gpt3-13b": ModelShape("gpt", 5120, 20480, 40, 40, 40, 50257, tie_embeddings=True, max_positions=2048),
}


def shape_from_preset(
    preset: str, overrides: dict[str, Any] | None = None, vocab_size: int | None = None
) -> ModelShape:
    """A llama preset of sizing/presets.py (with recipe-style overrides) or one of :data:`EXTRA_SHAPES`.

    The llama shape comes from the preset's fields as ``models.registry.build_config`` would set them, without
    building the transformers config; override keys the shape does not read (``rope_theta``, ...) change nothing
    here (the model builder checks them against LlamaConfig)."""
    if preset in EXTRA_SHAPES:
        shape = EXTRA_SHAPES[preset]
        if overrides:
            keys = {
                "num_hidden_layers": "num_layers",
                "num_attention_heads": "num_heads",
                "num_key_value_heads": "num_kv_heads",
                "max_position_embeddings": "max_positions",
            }
            fields = {keys.get(k, k): v for k, v in overrides.items()}
            bad = [k for k in fields if k not in shape.to_dict()]
            if bad:
                raise KeyError(f"model.overrides.{bad[0]}: not a field of the {preset} shape")
            shape = replace(shape, **fields)
        if vocab_size is not None and not (overrides and "vocab_size" in overrides):
            shape = replace(shape, vocab_size=vocab_size)
        return shape
    try:
        fields = preset_fields(preset, overrides, vocab_size)
    except KeyError as e:
        known = sorted([*PRESETS, *EXTRA_SHAPES])
        raise KeyError(f"{e.args[0]} (memory estimator knows: {', '.join(known)})") from None
    fields.setdefault("head_dim", fields["hidden_size"] // fields["num_attention_heads"])  # as transformers does
    return shape_of(SimpleNamespace(**fields), PRESET_FAMILY[preset])


def shape_of(config: Any, family: Family | None = None) -> ModelShape:
    """The ModelShape of a transformers config of one of canntrain's families (a preset's, or an init_from
    directory's: its ``model_type`` names the family), or of anything with its attributes and the ``family``
    given (read by name: no transformers import here)."""
    family = family or family_of(config)
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_key = family.config_key("num_key_value_heads")
    return ModelShape(
        family.shape_kind,
        config.hidden_size,
        getattr(config, family.config_key("intermediate_size")) or 4 * config.hidden_size,  # GPT-2's n_inner: None
        config.num_hidden_layers,
        heads,
        (getattr(config, kv_key) if kv_key else None) or heads,
        config.vocab_size,
        tie_embeddings=bool(config.tie_word_embeddings),
        max_positions=config.max_position_embeddings,
        family=family.name,
        explicit_head_dim=head_dim if head_dim * heads != config.hidden_size else 0,
        qkv_bias=family.qkv_bias(config),
        o_bias=family.o_bias(config),
        qk_norm=family.qk_norm,
        num_experts=getattr(config, family.config_key("num_experts"), None) or 1,
        experts_per_token=getattr(config, family.config_key("experts_per_token"), None) or 1,
        shared_expert_size=getattr(config, "shared_expert_intermediate_size", 0),
    )


def rebuild_recipe(shape: ModelShape) -> dict[str, Any]:
    """Recipe keys (``model.preset``, ``model.overrides``) that rebuild ``shape`` with its family's model code
    (for measuring): the family's tiny preset with every shape field overridden."""
    if shape.family not in FAMILIES or FAMILIES[shape.family].shape_kind != shape.kind:
        raise NotImplementedError(
            f"measuring needs model code; only the families of canntrain_core/families/ can be built (this "
            f"shape is {shape.kind!r}); use the analytic estimate"
        )
    family = FAMILIES[shape.family]
    sizes = dict(
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        vocab_size=shape.vocab_size,
        tie_word_embeddings=shape.tie_embeddings,
        max_position_embeddings=shape.max_positions,
    )
    if shape.kind == "moe":
        sizes.update(num_experts=shape.num_experts, experts_per_token=shape.experts_per_token)
        if shape.shared_expert_size:
            sizes["shared_expert_intermediate_size"] = shape.shared_expert_size
    overrides = {family.config_key(k): v for k, v in sizes.items() if family.config_key(k)}
    if shape.explicit_head_dim:
        overrides["head_dim"] = shape.explicit_head_dim
    return {"model.preset": family.tiny, "model.overrides": overrides}
