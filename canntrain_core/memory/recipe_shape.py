"""The ModelShape of a recipe, for the memory tools: what the analytic estimate of a recipe starts from.

It sits with the tools, above ``models/``, because an ``init_from`` directory's config.json is read through
``models.registry.model_config``; everything else about the estimate is pure arithmetic in ``sizing/``
(the :class:`~canntrain_core.sizing.setup.TrainSetup` half comes from
:func:`~canntrain_core.sizing.setup.setup_from_recipe`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from canntrain_core.errors import RecipeError
from canntrain_core.recipe import no_model_named
from canntrain_core.sizing.shapes import ModelShape, shape_from_preset, shape_of


def shape_from_recipe(recipe: Any) -> ModelShape:
    """The ModelShape of a recipe's model section: ``model.init_from``'s config.json when that directory
    is here, else the preset + overrides with the tokenizer's vocab size (so a recipe for a cluster can
    be estimated on a laptop: name the preset beside init_from)."""
    m = recipe.model
    if m.init_from and (Path(m.init_from) / "config.json").is_file():
        # deferred: start-up time (torch, transformers: only for init_from; canntrain_core.memory stays torch-free)
        from canntrain_core.models.registry import model_config

        return shape_of(model_config(m))
    vocab = None if "vocab_size" in m.overrides else recipe.data.tokenizer.vocab_size
    if m.preset is None and m.init_from:
        raise RecipeError(
            f"model.init_from: {m.init_from} is not here; to size its model elsewhere, name its shape beside it "
            "with model.preset (and model.overrides)"
        )
    if m.preset is None:
        raise no_model_named()
    return shape_from_preset(m.preset, m.overrides, vocab)
