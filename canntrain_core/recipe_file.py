"""Reading a recipe file: every way a file can fail to be a recipe is one RecipeError naming the file,
the line and the dotted key where there is one.

YAML loaders resolve duplicate keys to the last value silently, and a file handed over by mistake (a
notebook, a checkpoint, a directory, UTF-16, a pipe) would otherwise end in a traceback from deep
inside yaml. So the file is read as bytes, composed into a node tree, and checked in one walk before
anything is constructed; tests/bad_inputs/ holds one file per case.
"""

from __future__ import annotations

import json
import stat
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from canntrain_core.errors import RecipeError

# A recipe is a few KB; anything much bigger is some other file handed over by mistake.
_MAX_RECIPE_BYTES = 1 << 20
# Values after expanding YAML aliases: a recipe has hundreds, a "billion laughs" file billions.
_MAX_VALUES = 100_000
# Nesting levels: a recipe has three or four; deeper ones would hit Python's recursion limit later.
_MAX_DEPTH = 32

_TAG = "tag:yaml.org,2002:"
_SAFE_TAGS = {t for t in yaml.SafeLoader.yaml_constructors if t is not None} | {_TAG + "merge"}

# Leading bytes of binary files people hand over instead of a recipe.
_MAGIC = {
    b"PK\x03\x04": "a zip archive (a torch .pt/.bin checkpoint is one)",
    b"\x1f\x8b": "a gzip file",
    b"\x89PNG": "a PNG image",
    b"\x7fELF": "an executable",
    **{b"\x80" + bytes([protocol]): "a Python pickle" for protocol in (2, 3, 4, 5)},
}


def _read_text(p: Path, source: str) -> str:
    """The file's text; a RecipeError that says what the path is when it is not a UTF-8 text file."""
    try:
        st = p.stat()
    except (FileNotFoundError, NotADirectoryError):
        if p.is_symlink():
            raise RecipeError(
                f"{source}: recipe file not found (a symlink to {str(p.readlink())!r}, which does not exist)"
            ) from None
        raise RecipeError(f"{source}: recipe file not found") from None
    except OSError as e:  # e.g. a parent directory this user may not enter
        raise RecipeError(f"{source}: cannot be read: {e.strerror or e}") from None
    if stat.S_ISDIR(st.st_mode):
        raise RecipeError(_directory_message(p, source))
    if not stat.S_ISREG(st.st_mode):  # reading a named pipe blocks until someone writes, a device never ends
        raise RecipeError(f"{source}: not a regular file (a pipe, socket or device); a recipe is a YAML file")
    if st.st_size > _MAX_RECIPE_BYTES:
        raise RecipeError(
            f"{source}: {st.st_size:,} bytes, too big for a recipe (a few KB of YAML): is this a data file?"
        )
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise RecipeError(f"{source}: cannot be read: {e.strerror or e}") from None
    return _decode(raw, source)


def _directory_message(p: Path, source: str) -> str:
    if (p / "recipe.resolved.yaml").is_file():  # a run directory: point at the recipe it holds
        return f"{source}: is a run directory, not a recipe file; its recipe is {p / 'recipe.resolved.yaml'}"
    yamls = sorted(q.name for q in p.glob("*.y*ml"))[:5]
    holds = f" (it holds {', '.join(yamls)})" if yamls else ""
    return f"{source}: is a directory, not a recipe file{holds}"


def _decode(raw: bytes, source: str) -> str:
    if raw.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise RecipeError(f"{source}: UTF-16 text, not UTF-8; save the file as UTF-8")
    nul = raw.find(b"\x00")
    if nul >= 0:
        kind = next((f": {what}" for magic, what in _MAGIC.items() if raw.startswith(magic)), "")
        raise RecipeError(f"{source}: a binary file{kind}, not a YAML recipe (NUL byte at byte {nul})")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise RecipeError(
            f"{source}, line {line}: not UTF-8 text (byte 0x{raw[e.start]:02x} at byte {e.start}: {e.reason}); "
            "save the file as UTF-8"
        ) from None


def _compose(text: str, source: str) -> yaml.Node | None:
    """The one YAML document in `text` as a node tree (None when it holds nothing)."""
    try:
        docs = [d for d in yaml.compose_all(text, Loader=yaml.SafeLoader) if not _is_empty(d)]
    except yaml.reader.ReaderError as e:
        line = text.count("\n", 0, e.position) + 1
        raise RecipeError(
            f"{source}, line {line}: control character U+{e.character:04X} is not allowed in YAML"
        ) from None
    except yaml.YAMLError as e:
        raise RecipeError(_syntax_message(e, text, source)) from None
    except RecursionError:  # the composer recurses once per nesting level
        raise RecipeError(f"{source}: nested too deeply to be a recipe") from None
    if len(docs) > 1:
        raise RecipeError(
            f"{source}, line {docs[1].start_mark.line + 1}: a second YAML document starts here (after '---'); "
            "a recipe is one document"
        )
    return docs[0] if docs else None


def _is_empty(node: yaml.Node) -> bool:
    return isinstance(node, yaml.ScalarNode) and node.tag == _TAG + "null"


def _syntax_message(e: yaml.YAMLError, text: str, source: str) -> str:
    mark = getattr(e, "problem_mark", None)
    line = f", line {mark.line + 1}" if mark is not None else ""
    problem = getattr(e, "problem", None) or str(e)
    if _is_json_lines(text):
        return f"{source}: JSON Lines (one JSON object per line, like metrics.jsonl or a .jsonl corpus), not a recipe"
    hint = " (YAML indents with spaces, not tabs)" if "'\\t'" in problem else ""
    return f"{source}{line}: YAML syntax error: {problem}{hint}"


def _is_json_lines(text: str) -> bool:
    rows = [r for r in text.splitlines() if r.strip() and not r.lstrip().startswith("#")]
    try:
        return len(rows) > 1 and all(isinstance(json.loads(r), dict) for r in rows)
    except ValueError:
        return False


# ---------------------------------------------------------------------------- checking the tree


def _kind(node: yaml.Node) -> str:
    """What a node is, in words, for messages."""
    if isinstance(node, yaml.MappingNode):
        return "a mapping"
    if isinstance(node, yaml.SequenceNode):
        return f"a list of {len(node.value)} item(s)"
    if _is_empty(node):
        return "null"
    what = {"null": "null", "bool": "a boolean", "int": "a number", "float": "a number", "str": "a string"}
    value = node.value if len(node.value) <= 60 else node.value[:57] + "..."
    return f"{what.get(node.tag.removeprefix(_TAG), 'a value')} ({value!r})"


def _line(node: yaml.Node) -> int:
    return node.start_mark.line + 1


def _sections(model: type[BaseModel], prefix: str = "") -> set[str]:
    """Dotted keys whose value is a section (a nested schema model): data, data.tokenizer, ..."""
    out: set[str] = set()
    for name, f in model.model_fields.items():
        if isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel):
            out |= {prefix + name} | _sections(f.annotation, f"{prefix}{name}.")
    return out


# Signatures of files that are not recipes: top-level keys -> what the file is.
_LOOKS_LIKE = [
    (
        {"nbformat", "cells"},
        "a Jupyter notebook, not a recipe; give the notebook's recipe YAML (cookbook/<model>/configs/)",
    ),
    ({"added_tokens", "model"}, "a tokenizers tokenizer.json, not a recipe"),
    ({"model_type"}, "a Hugging Face model config (config.json), not a recipe"),
    ({"corpus_source", "tokenizer_hash"}, "a run's data.json, not a recipe; the run's recipe is recipe.resolved.yaml"),
]


def _check_top(root: yaml.Node | None, source: str, schema: type[BaseModel]) -> None:
    """The top level must be a mapping of recipe sections, not a list, a scalar or another kind of file."""
    if root is None:
        raise RecipeError(
            f"{source}: holds no settings (empty, or only comments); a recipe is a mapping of sections "
            "such as model:, data:, optim:"
        )
    if not isinstance(root, yaml.MappingNode):
        raise RecipeError(
            f"{source}, line {_line(root)}: the top level is {_kind(root)}, not a mapping of sections "
            "(model:, data:, optim:, ...)"
        )
    keys = {k.value for k, _ in root.value if isinstance(k, yaml.ScalarNode)}
    for signature, what in _LOOKS_LIKE:
        if signature <= keys:
            raise RecipeError(f"{source}: {what}")
    known = list(schema.model_fields)
    if keys and not keys & set(known) and (root.flow_style or len(keys) >= 3):
        form = "a JSON object" if root.flow_style else "a mapping"
        shown = ", ".join(sorted(keys)[:6]) + (", ..." if len(keys) > 6 else "")
        raise RecipeError(
            f"{source}: {form} whose keys ({shown}) are not recipe sections "
            f"({', '.join(known)}): is this the right file?"
        )


class _TreeCheck:
    """One walk over the composed YAML: the line of every dotted key, and every problem YAML loaders
    hide (duplicate keys, which they resolve to the last value), or that would end in a traceback."""

    def __init__(self, source: str, schema: type[BaseModel]):
        self.source = source
        self.lines: dict[str, int] = {}
        self.problems: list[str] = []
        self.sections = _sections(schema)
        self._size: dict[int, int] = {}  # id(node) -> values below it, aliases expanded
        self._path: set[int] = set()

    def problem(self, node: yaml.Node, key: str, msg: str) -> None:
        self.problems.append(f"{self.source}, line {_line(node)}: {key or '<root>'}: {msg}")

    def walk(self, node: yaml.Node, key: str = "") -> int:
        """Check `node` (at dotted `key`); return how many values it expands to."""
        if id(node) in self._path:
            self.problem(node, key, "a YAML alias that refers to itself")
            return 1
        if id(node) in self._size:  # an alias: checked where its anchor is
            return self._size[id(node)]
        if len(self._path) >= _MAX_DEPTH:
            raise RecipeError(
                f"{self.source}, line {_line(node)}: {key}: nested more than {_MAX_DEPTH} levels deep; not a recipe"
            )
        self._path.add(id(node))
        size = 1 + self._children(node, key)
        self._path.discard(id(node))
        self._size[id(node)] = size
        if size > _MAX_VALUES:
            raise RecipeError(
                f"{self.source}, line {_line(node)}: {key or '<root>'}: expands to more than "
                f"{_MAX_VALUES:,} values through YAML aliases; not a recipe"
            )
        return size

    def _children(self, node: yaml.Node, key: str) -> int:
        if node.tag not in _SAFE_TAGS:
            self.problem(
                node,
                key,
                f"YAML tag {node.tag.replace(_TAG, '!!')!r} is not allowed in a recipe (recipes hold plain values)",
            )
            return 0
        if key in self.sections and not isinstance(node, yaml.MappingNode):
            hint = "indent its keys below it, or delete the line" if _is_empty(node) else "give its keys below it"
            self.problem(node, key, f"a section must be a mapping of keys, got {_kind(node)}; {hint}")
            return 0
        if isinstance(node, yaml.SequenceNode):
            return sum(self.walk(item, f"{key}[{i}]") for i, item in enumerate(node.value))
        if isinstance(node, yaml.MappingNode):
            return self._mapping(node, key)
        if node.tag == _TAG + "timestamp":
            self._timestamp(node, key)
        return 0

    def _mapping(self, node: yaml.MappingNode, key: str) -> int:
        size, first, merged = 0, {}, []
        for k, v in node.value:
            if k.tag == _TAG + "merge":  # `<<: *anchor`: keys written here override these, by design
                merged += v.value if isinstance(v, yaml.SequenceNode) else [v]  # `<<: [*a, *b]` merges both
                continue
            if not (isinstance(k, yaml.ScalarNode) and k.tag == _TAG + "str"):
                hint = "; quote it if it is a name" if isinstance(k, yaml.ScalarNode) else ""
                self.problem(k, key, f"a key must be a plain name, got {_kind(k)}{hint}")
                continue
            dotted = f"{key}.{k.value}" if key else k.value
            if k.value in first:
                self.problem(k, dotted, f"duplicate key (first at line {first[k.value]})")
            else:
                first[k.value] = _line(k)
                self.lines[dotted] = _line(k)
            size += self.walk(v, dotted)
        for v in merged:
            if not isinstance(v, yaml.MappingNode):
                self.problem(v, key, f"'<<' merges a mapping (or a list of mappings), got {_kind(v)}")
                continue
            lines = dict(self.lines)
            size += self.walk(v, key)
            self.lines = {**self.lines, **lines}  # a key's line is where it is written, not merged from
        return size

    def _timestamp(self, node: yaml.ScalarNode, key: str) -> None:
        try:
            yaml.SafeLoader("").construct_yaml_timestamp(node)
        except ValueError as e:  # e.g. 2024-13-01: YAML reads it as a date, and the date is invalid
            self.problem(node, key, f"{node.value!r} reads as a date but is not one ({e}); quote it")


def read_recipe_file(p: Path, source: str, schema: type[BaseModel]) -> tuple[dict[str, Any], dict[str, int]]:
    """The recipe file's settings as plain data, and the line of each dotted key; a RecipeError naming
    the file (and line, and key) for anything that is not a readable YAML mapping of ``schema``'s sections."""
    text = _read_text(p, source)
    root = _compose(text, source)
    _check_top(root, source, schema)
    check = _TreeCheck(source, schema)
    check.walk(root)
    if check.problems:
        raise RecipeError("invalid recipe:\n  " + "\n  ".join(check.problems))
    try:
        data = yaml.SafeLoader("").construct_document(root)
    except (yaml.YAMLError, ValueError) as e:  # a safety net: the walk checks what construction rejects
        mark = getattr(e, "problem_mark", None)
        line = f", line {mark.line + 1}" if mark is not None else ""
        raise RecipeError(f"{source}{line}: {getattr(e, 'problem', None) or e}") from None
    return data, check.lines
