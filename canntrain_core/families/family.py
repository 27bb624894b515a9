"""What a model family says about itself, as data: pure (no torch, no transformers), so the recipe schema, the
memory estimator and the planner read it as well as the model builder, the TP plan and the kernels.

A family names transformers' classes by their names; ``models/classes.py`` resolves them. Everything that
differs between families is a field here; code never branches on a family's name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable


# The shape of every family's tiny preset (a few million parameters: trains on two CPU cores in seconds).
TINY_SHAPE: dict[str, Any] = dict(
    hidden_size=128,
    intermediate_size=384,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=4096,
    max_position_embeddings=2048,
)


def layer_windows(config: Any) -> list[int | None]:
    """Each layer's attention window (None: causal over the whole sequence): Mistral's ``sliding_window`` on
    every layer; Qwen's on the layers its ``layer_types`` mark sliding (``use_sliding_window``, from
    ``max_window_layers`` on). The one reading of it for CausalLM's masks and the fused attention."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types is not None:
        return [window if t == "sliding_attention" else None for t in types]
    return [window] * config.num_hidden_layers


@dataclass(frozen=True)
class HFName:
    """canntrain's tensors named ``ours`` (a regular expression) live in the files' ``theirs`` (``{0}``, ``{1}``:
    the pattern's groups; ``{e}``: the expert). ``experts``: ours stacks one files' tensor per expert along its
    first dimension, in part ``part`` of ``parts`` of its second (Mixtral's w1 and w3 in gate_up_proj); else ours
    is part ``part`` of ``parts`` of the files' tensor's last dimension (GPT-2's q, k, v in c_attn).
    ``transposed``: the files store it transposed (GPT-2's Conv1D)."""

    ours: str
    theirs: str
    transposed: bool = False
    part: int = 0
    parts: int = 1
    experts: bool = False


@dataclass(frozen=True)
class Family:
    name: str  # also model.type in a recipe
    model_types: tuple[str, ...]  # config.json's model_type values it reads
    config_class: str  # transformers' configuration class
    causal_lm_class: str  # transformers' ...ForCausalLM
    presets: dict[str, dict[str, Any]]  # name -> config fields (public shapes, and a tiny-* one for CPU)
    tiny: str  # the preset that trains on CPU in seconds (tests, notebooks, the memory measurement)
    common: dict[str, Any]  # config fields every preset of the family shares
    # Shape facts (the estimator's parameter and FLOP counts; config -> value, read by attribute name):
    qkv_bias: Callable[[Any], bool] = lambda c: bool(getattr(c, "attention_bias", False))
    o_bias: Callable[[Any], bool] = lambda c: bool(getattr(c, "attention_bias", False))
    qk_norm: bool = False  # an RMSNorm over each head's query and key (Qwen3)
    # Which of transformers' module classes the fused kernels replace (class name -> "norm", "mlp", "attention"
    # or "experts": a mixture of experts' expert tensors); a module left out keeps transformers' forward.
    kernel_modules: dict[str, str] = field(default_factory=dict)
    # TP: norms applied per attention head (their input is split over heads): their weights are replicated
    # over tp and their gradients summed over it.
    head_norms: tuple[str, ...] = ()
    # The estimator's block kind (sizing/shapes.py): "llama" (RMSNorm, RoPE, SwiGLU) or "gpt" (LayerNorm,
    # learned positions, GELU MLP, biases).
    shape_kind: str = "llama"
    # Config keys by their Llama names where the family's config calls them otherwise ("" : it has none).
    config_keys: dict[str, str] = field(default_factory=dict)
    # canntrain's own module tree for the family (a class of models/, Llama's module names) where transformers'
    # tree cannot be split by TP as it stands (GPT-2's fused, transposed q/k/v); "": transformers' class.
    own_class: str = ""
    # How canntrain's parameter names map onto the Hugging Face files' where they differ (models/hf_names.py);
    # a name no entry matches is the same in both. Empty: the same names and layouts throughout.
    hf_names: tuple[HFName, ...] = ()
    # Residual output projections initialised with std / sqrt(2 x layers) (GPT-2's scheme); names' endings.
    scaled_init: tuple[str, ...] = ()
    # A mixture of experts: transformers' router module class, whose first output is the router logits (the
    # load-balancing loss reads them); "": a dense model.
    router_class: str = ""
    # What of a config canntrain does not build, in one line naming the keys ('' : it builds all of it).
    not_built: Callable[[Any], str] = lambda c: ""

    def config_key(self, name: str) -> str:
        """The family config's key for the Llama-named ``name`` ('' when the family has no such field)."""
        return self.config_keys.get(name, name)
