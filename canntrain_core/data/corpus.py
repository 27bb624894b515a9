"""The text corpus: the interpreter's own standard library, a directory of text files, or a .jsonl file.

The default corpus ships with Python itself (DESIGN: no downloads at run time). Everything here is
deterministic: files are listed in sorted order, and a size cap (``data.max_bytes`` /
``data.max_files``) picks a spread-out subset by ordering documents by the sha256 of their name,
so a tiny recipe sees a bit of every corner of the stdlib rather than just ``abc.py``..``ast.py``.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

from canntrain_core.data.cache import DataError

# Directories never part of a corpus: installed packages are not "the standard library",
# and caches / VCS metadata are not text anyone wrote.
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


@dataclass(frozen=True)
class Document:
    """One training document. `name` is stable across machines (a relative path, or file:line)."""

    name: str
    text: str

    @property
    def n_bytes(self) -> int:
        return len(self.text.encode("utf-8"))


@dataclass(frozen=True)
class Corpus:
    """The selected documents (sorted by name) and the hashes that identify them."""

    source: str  # "stdlib", or the resolved path of the directory / .jsonl file
    documents: tuple[Document, ...] = field(repr=False)
    n_bytes: int
    # sha256 of the selected names + sizes: cheap to compare, shown in info.
    files_hash: str
    # sha256 of names + contents: what cache keys use, so an edited file misses the cache.
    content_hash: str

    @property
    def n_documents(self) -> int:
        return len(self.documents)

    def texts(self) -> list[str]:
        return [d.text for d in self.documents]


def stdlib_dir() -> Path:
    """The running interpreter's standard-library directory."""
    return Path(sysconfig.get_paths()["stdlib"])


def load_corpus(
    source: str = "stdlib",
    *,
    text_field: str = "text",
    max_bytes: int | None = None,
    max_files: int | None = None,
) -> Corpus:
    """Read the corpus named by ``data.source`` and apply the size caps.

    ``source`` is ``"stdlib"``, a directory (every non-hidden UTF-8 text file below it,
    recursively) or a ``.jsonl`` file with the text of each record under ``text_field``.
    Raises :class:`DataError` naming ``data.source`` (or the file and line) on any problem.
    """
    if source == "stdlib":
        root = stdlib_dir()
        candidates = _walk_files(root, suffixes=(".py",))
        label = "stdlib"
    else:
        path = Path(source).expanduser()
        if not path.exists():
            raise DataError(
                f"data.source: {source!r} does not exist (cwd {os.getcwd()}); expected 'stdlib', "
                "a directory of text files or a .jsonl file"
            )
        path = path.resolve()
        label = str(path)
        if path.is_dir():
            candidates = _walk_files(path, suffixes=None)
        elif path.suffix == ".jsonl":
            candidates = _jsonl_records(path, text_field)
        else:
            raise DataError(
                f"data.source: {source!r} is a file but not a .jsonl file; give 'stdlib', "
                "a directory of text files or a .jsonl file"
            )

    docs = _select(candidates, max_bytes=max_bytes, max_files=max_files, source=source)
    docs.sort(key=lambda d: d.name)
    return Corpus(
        source=label,
        documents=tuple(docs),
        n_bytes=sum(d.n_bytes for d in docs),
        files_hash=_files_hash(docs),
        content_hash=_content_hash(docs),
    )


# ---------------------------------------------------------------------------- candidates

# A candidate is (name, size in bytes, read) where read() returns the text or None to skip it.
# Reading is deferred so a capped corpus only reads the files it keeps.
_Candidate = tuple[str, int, Callable[[], "str | None"]]


def _walk_files(root: Path, suffixes: tuple[str, ...] | None) -> list[_Candidate]:
    """Files under `root` in sorted relative-path order; symlinked directories are not followed."""
    out: list[_Candidate] = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Prune in place so os.walk does not descend; sorting keeps the walk order stable.
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("."))
        for name in sorted(filenames):
            if name.startswith(".") or (suffixes is not None and not name.endswith(suffixes)):
                continue
            full = Path(dirpath) / name
            if not full.is_file():
                continue
            size = full.stat().st_size
            if size == 0:
                continue
            rel = full.relative_to(root).as_posix()
            out.append((rel, size, _text_reader(full)))
    out.sort(key=lambda c: c[0])
    return out


def _text_reader(path: Path) -> Callable[[], str | None]:
    def read() -> str | None:
        data = path.read_bytes()
        if b"\x00" in data:  # binary file (e.g. an image or a .pyc) in a user directory
            return None
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:  # e.g. the stdlib's deliberately latin-1 test files
            return None

    return read


def _jsonl_records(path: Path, text_field: str) -> list[_Candidate]:
    """Every record of a .jsonl file; a malformed line is an error naming file and line."""
    out: list[_Candidate] = []
    with open(path, encoding="utf-8") as f:
        try:
            lines = list(f)
        except UnicodeDecodeError as e:
            raise DataError(f"{path}: not valid UTF-8 ({e.reason} at byte {e.start})") from None
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}, line {lineno}: invalid JSON: {e.msg} (column {e.colno})") from None
        if not isinstance(record, dict):
            raise DataError(f"{path}, line {lineno}: expected a JSON object, got {type(record).__name__}")
        if text_field not in record:
            raise DataError(
                f"{path}, line {lineno}: record has no key {text_field!r} (set data.text_field; "
                f"keys here: {', '.join(sorted(record)) or 'none'})"
            )
        text = record[text_field]
        if not isinstance(text, str):
            raise DataError(f"{path}, line {lineno}: {text_field!r} must be a string, got {type(text).__name__}")
        if text:
            out.append((f"{path.name}:{lineno}", len(text.encode("utf-8")), lambda t=text: t))
    return out


# ---------------------------------------------------------------------------- selection


def _spread_order(name: str) -> str:
    return hashlib.sha256(name.encode("utf-8")).hexdigest()


def _select(
    candidates: Iterable[_Candidate], *, max_bytes: int | None, max_files: int | None, source: str
) -> list[Document]:
    """All readable candidates, or, under a cap, a deterministic spread-out subset.

    Under a cap, candidates are visited in sha256(name) order and each is kept if it still fits
    in `max_bytes` (a too-large file is skipped, not a stop, so the subset fills the cap).
    """
    candidates = list(candidates)
    capped = max_bytes is not None or max_files is not None
    if capped:
        candidates.sort(key=lambda c: _spread_order(c[0]))
    docs: list[Document] = []
    total = 0
    for name, size, read in candidates:
        if max_files is not None and len(docs) >= max_files:
            break
        if max_bytes is not None and total + size > max_bytes:
            continue
        text = read()
        if not text:
            continue
        docs.append(Document(name, text))
        total += len(text.encode("utf-8"))
    if not docs:
        if candidates and max_bytes is not None:
            smallest = min(c[1] for c in candidates)
            raise DataError(
                f"data.max_bytes={max_bytes} is smaller than every document in {source!r} "
                f"(the smallest has {smallest} bytes)"
            )
        raise DataError(f"data.source: no UTF-8 text documents found in {source!r}")
    return docs


def _files_hash(docs: list[Document]) -> str:
    h = hashlib.sha256()
    for d in docs:
        h.update(f"{d.name}\t{d.n_bytes}\n".encode("utf-8"))
    return h.hexdigest()


def _content_hash(docs: list[Document]) -> str:
    h = hashlib.sha256()
    for d in docs:
        h.update(f"{d.name}\t{hashlib.sha256(d.text.encode('utf-8')).hexdigest()}\n".encode("utf-8"))
    return h.hexdigest()
