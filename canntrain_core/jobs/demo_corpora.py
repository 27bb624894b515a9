"""The data notebook's two corpora, made from what ships with Python (no download): the standard library's
code, and the prose of its docstrings, each as a JSONL file of ``{"text": ...}`` records."""

from __future__ import annotations

import ast
import json
from pathlib import Path

from canntrain_core.data.corpus import list_inputs, spread_order


def write_demo_corpora(out: str | Path, code_mb: float = 4.0) -> dict[str, Path]:
    """``out/code.jsonl`` (stdlib modules, spread over the library, about ``code_mb`` MB) and ``out/prose.jsonl``
    (the docstrings of those modules longer than 200 characters, one record each). Written once."""
    out = Path(out)
    paths = {"code": out / "code.jsonl", "prose": out / "prose.jsonl"}
    if all(p.is_file() for p in paths.values()):
        return paths
    out.mkdir(parents=True, exist_ok=True)
    code, prose, size = [], [], 0
    for i in sorted(list_inputs("stdlib"), key=lambda i: spread_order(i.name)):
        if size >= code_mb * 1e6:
            break
        try:
            text = Path(i.path).read_text(encoding="utf-8")
            tree = ast.parse(text)
        except (UnicodeDecodeError, SyntaxError, ValueError):
            continue  # the stdlib's deliberately broken test files
        code.append(text)
        size += len(text.encode())
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) > 200:
                    prose.append(doc)
    for name, texts in (("code", code), ("prose", prose)):
        tmp = paths[name].with_suffix(".tmp")
        tmp.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
        tmp.rename(paths[name])
    return paths
