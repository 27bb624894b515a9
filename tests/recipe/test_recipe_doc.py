"""docs/recipe.md is the schema's: regenerated here, it must equal the committed file, and every key has a meaning."""

from canntrain_core.recipe_doc import DOC, reference, rows


def test_the_key_reference_is_current_and_every_key_is_explained():
    assert DOC.read_text() == reference(), "run: python -m canntrain_core.recipe_doc > docs/recipe.md"
    unexplained = [key for key, kind, _, meaning in rows() if not meaning]
    assert not unexplained, unexplained
    keys = [key for key, *_ in rows()]
    assert {"model.preset", "data.sources", "distributed.target_device", "rlhf.kl_estimator"} <= set(keys)
