"""Recipe drift on resume: what changed between the recipe a checkpoint was written with and this one.

Each changed dotted key falls in one kind (the first matching rule in ``RULES`` wins):

- ``bookkeeping``: logging, max_steps, names and paths, worker counts; passes silently;
- ``layout``: parallel sizes and schedule, recompute; stated (the checkpoint reshards; the math
  is the same);
- ``math``: anything else (lr and schedule, batch and accumulation, sequence length, data and
  tokenizer, seed, precision, kernels); listed ``key: old -> new`` before training;
- ``shape``: the model's shape or vocabulary; the checkpoint's tensors would not load, so the
  resume is refused before any work.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from canntrain_core.recipe import Recipe, RecipeError

# LlamaConfig fields that change a tensor's shape (or which tensors exist).
SHAPE_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
    "head_dim",
    "tie_word_embeddings",
    "attention_bias",
    "mlp_bias",
)

RULES: list[tuple[str, str]] = [
    ("logging.", "bookkeeping"),
    ("optim.max_steps", "bookkeeping"),
    ("optim.epochs", "bookkeeping"),
    ("experiment.name", "bookkeeping"),
    ("experiment.output_dir", "bookkeeping"),
    ("resume_from", "bookkeeping"),
    ("data.cache_dir", "bookkeeping"),
    ("data.num_workers", "bookkeeping"),
    ("data.persistent_workers", "bookkeeping"),
    ("distributed.timeout_seconds", "bookkeeping"),
    ("distributed.allow_cross_node_tp", "bookkeeping"),
    ("distributed.memory_budget_gb", "bookkeeping"),
    ("distributed.target_device", "bookkeeping"),
    ("model.type", "shape"),
    ("model.preset", "shape"),
    ("data.tokenizer.vocab_size", "shape"),
    ("lora.enabled", "shape"),
    ("lora.rank", "shape"),
    ("lora.target_modules", "shape"),
    *((f"model.overrides.{f}", "shape") for f in SHAPE_FIELDS),
    ("distributed.", "layout"),
    ("model.activation_checkpointing", "layout"),
]


def kind_of(key: str) -> str:
    for prefix, kind in RULES:
        if key == prefix or (prefix.endswith(".") and key.startswith(prefix)):
            return kind
    return "math"


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


@dataclass
class Drift:
    changes: dict[str, list[tuple[str, Any, Any]]] = field(default_factory=dict)  # kind -> (key, old, new)

    def of(self, kind: str) -> list[tuple[str, Any, Any]]:
        return self.changes.get(kind, [])

    def lines(self, kind: str) -> list[str]:
        return [f"{k}: {_show(old)} -> {_show(new)}" for k, old, new in self.of(kind)]


def _show(v: Any) -> str:
    return "(not set)" if v is _ABSENT else repr(v) if isinstance(v, str) else str(v)


_ABSENT = object()


def recipe_drift(old: dict[str, Any], new: Recipe) -> Drift:
    """Compare the checkpoint's recipe (a dict; its schema may be older) with the one resuming it.

    A key the old recipe lacks was added to the schema later: the old run had its default.
    """
    defaults = flatten(Recipe().to_dict())
    before = {**defaults, **flatten(old)}
    after = flatten(new.to_dict())
    drift = Drift()
    for key in sorted(set(before) | set(after)):
        a, b = before.get(key, _ABSENT), after.get(key, _ABSENT)
        if a != b:  # both sides are JSON-like (yaml / model_dump(mode='json')): tuples are lists
            drift.changes.setdefault(kind_of(key), []).append((key, a, b))
    return drift


def check_resume(
    checkpoint: str,
    old: dict[str, Any],
    new: Recipe,
    old_config: dict[str, Any] | None = None,
    new_config: dict[str, Any] | None = None,
) -> list[str]:
    """Refuse a resume that cannot load; return the lines to print for the changes that can.

    ``old_config`` / ``new_config``: the model's transformers config then and now (they catch a shape
    change that no recipe key shows, e.g. another ``model.init_from`` directory).
    """
    drift = recipe_drift(old, new)
    shape = drift.lines("shape")
    if old_config is not None and new_config is not None and not shape:
        shape = [
            f"model {f}: {old_config.get(f)} -> {new_config.get(f)}"
            for f in SHAPE_FIELDS
            if old_config.get(f) != new_config.get(f)
        ]
    if shape:
        raise RecipeError(
            f"cannot resume from {checkpoint}: the recipe changes the model's shape, so the checkpoint's "
            "tensors would not load:\n  " + "\n  ".join(shape) + "\n  (set these back, or start a new run directory)"
        )
    out = []
    if drift.of("layout"):
        out.append("resuming under a new layout (the checkpoint reshards): " + "; ".join(drift.lines("layout")))
    if drift.of("math"):
        out.append(f"resuming with a recipe that changes the training math since {checkpoint}:")
        out += [f"  {line}" for line in drift.lines("math")]
    return out
