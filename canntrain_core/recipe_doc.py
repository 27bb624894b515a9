"""The recipe-key reference (``docs/recipe.md``), generated from the schema: every key's dotted name, type, default
and meaning. The meaning is the field's ``description``, else the comment written with it in ``recipe.py`` (the
lines just above it and the one beside it), so the reference cannot drift from the code:
``tests/recipe/test_recipe_doc.py`` regenerates it and compares.

    python -m canntrain_core.recipe_doc > docs/recipe.md
"""

from __future__ import annotations

import ast
import inspect
import io
import sys
import tokenize
import typing
from pathlib import Path

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from canntrain_core import recipe as schema
from canntrain_core.recipe import Recipe

DOC = Path(__file__).resolve().parents[1] / "docs" / "recipe.md"  # in a checkout
HEADER = """# Recipe keys

Every key a recipe may set, by section: its type, its default and what it does. Generated from the schema
(`canntrain_core/recipe.py`) by `python -m canntrain_core.recipe_doc > docs/recipe.md`; a test keeps it current.
A YAML recipe, `--set KEY=VALUE` and papermill's `overrides` use the same dotted names. Keys that only some
stages read are refused for the others, naming the stage (`train_mode`).
"""


def field_comments() -> dict[tuple[str, str], str]:
    """(class name, field name) -> the comment written with the field in recipe.py."""
    source = inspect.getsource(schema)
    comments = {
        tok.start[0]: tok.string.lstrip("#").strip()
        for tok in tokenize.generate_tokens(io.StringIO(source).readline)
        if tok.type == tokenize.COMMENT
    }
    lines = source.splitlines()
    found = {}
    for cls in ast.parse(source).body:
        if not isinstance(cls, ast.ClassDef):
            continue
        for node in cls.body:
            if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
                continue
            above, line = [], node.lineno - 1
            while line in comments and lines[line - 1].lstrip().startswith("#"):  # whole-line comments only
                above.insert(0, comments[line])
                line -= 1
            beside = [comments[n] for n in range(node.lineno, node.end_lineno + 1) if n in comments]
            found[(cls.name, node.target.id)] = " ".join(above + beside)
    return found


def _type_text(annotation) -> str:
    text = repr(annotation) if typing.get_origin(annotation) else getattr(annotation, "__name__", repr(annotation))
    return text.replace("typing.", "").replace("NoneType", "None")


def _default_text(field) -> str:
    if field.default_factory is not None:
        value = field.default_factory()
        return "(section)" if isinstance(value, BaseModel) else f"`{value!r}`"
    if field.default is PydanticUndefined:
        return "required"
    return f"`{field.default!r}`"


def rows(model: type[BaseModel] = Recipe, prefix: str = "", comments=None) -> list[tuple[str, str, str, str]]:
    """(dotted key, type, default, meaning) of every key under ``model``, sections expanded."""
    comments = field_comments() if comments is None else comments
    out = []
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        meaning = field.description or comments.get((model.__name__, name), "")
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            out.append((key, "section", "", meaning or " ".join((annotation.__doc__ or "").split())))
            out += rows(annotation, key + ".", comments)
            continue
        out.append((key, _type_text(annotation), _default_text(field), meaning))
    return out


def reference() -> str:
    """docs/recipe.md's text: the top-level keys, then a table per section."""
    all_rows = rows()
    groups: dict[str, list] = {"": [r for r in all_rows if "." not in r[0] and r[1] != "section"]}
    for r in all_rows:
        if "." in r[0]:
            groups.setdefault(r[0].split(".")[0], []).append(r)
    lines = [HEADER]
    for top, members in groups.items():
        lines += [
            "",
            f"## `{top}`" if top else "## Top level",
            "",
            "| key | type | default | meaning |",
            "|---|---|---|---|",
        ]
        for key, kind, default, meaning in members:
            kind = "section" if kind == "section" else f"`{kind}`"
            lines.append(
                f"| `{key}` | {kind.replace('|', chr(92) + '|')} | {default} | {meaning.replace('|', chr(92) + '|')} |"
            )
    return "\n".join(lines) + "\n"


def main() -> int:
    sys.stdout.write(reference())
    return 0


if __name__ == "__main__":
    sys.exit(main())
