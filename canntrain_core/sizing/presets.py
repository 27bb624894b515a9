"""Model presets by name: every family's (``canntrain_core/families/``), each the transformers config fields
of a public shape (or a tiny one for CPU).

``models/registry.py`` builds the family's config from them; the recipe schema checks ``model.preset``
against them; the memory estimator derives a :class:`~canntrain_core.sizing.shapes.ModelShape` from them
without importing transformers.
"""

from __future__ import annotations

from typing import Any

from canntrain_core.families import FAMILIES, PRESET_FAMILY

PRESETS: dict[str, dict[str, Any]] = {name: fields for f in FAMILIES.values() for name, fields in f.presets.items()}


def preset_fields(
    preset: str, overrides: dict[str, Any] | None = None, vocab_size: int | None = None
) -> dict[str, Any]:
    """The config fields of a preset with recipe overrides applied: its family's ``common`` fields, the
    preset's, then ``vocab_size`` (the tokenizer's), then ``overrides`` (which win over the tokenizer's vocab
    size). Raises KeyError for an unknown preset; override keys are not checked here (the model builder checks
    them against the family's config class)."""
    if preset not in PRESETS:
        raise KeyError(f"model.preset: unknown preset {preset!r}; known: {', '.join(sorted(PRESETS))}")
    fields = {**PRESET_FAMILY[preset].common, **PRESETS[preset]}
    if vocab_size is not None:
        fields["vocab_size"] = vocab_size
    fields.update(overrides or {})
    return fields
