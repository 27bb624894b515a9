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
    # "name[:line]: reason" for each record or file left out as not usable text (data.on_bad_record).
    bad_records: tuple[str, ...] = field(default=(), repr=False)

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
    on_bad_record: str = "error",
) -> Corpus:
    """Read the corpus named by ``data.source`` and apply the size caps.

    ``source`` is ``"stdlib"``, a directory (every non-hidden text file below it, recursively)
    or a ``.jsonl`` file with the text of each record under ``text_field``. A record or file that
    is not usable text raises :class:`DataError` naming the file and line, or with
    ``on_bad_record="skip"`` is left out and listed in ``Corpus.bad_records``. Any other problem
    is a DataError naming ``data.source``.
    """
    # The stdlib's deliberately non-UTF-8 test files are not the user's data: always skipped (and counted).
    bad = _BadRecords("skip" if source == "stdlib" else on_bad_record)
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
            candidates = _jsonl_records(path, text_field, bad)
        else:
            raise DataError(
                f"data.source: {source!r} is a file but not a .jsonl file; give 'stdlib', "
                "a directory of text files or a .jsonl file"
            )

    docs = _select(candidates, bad, max_bytes=max_bytes, max_files=max_files, source=source)
    docs.sort(key=lambda d: d.name)
    return Corpus(
        source=label,
        documents=tuple(docs),
        n_bytes=sum(d.n_bytes for d in docs),
        files_hash=_files_hash(docs),
        content_hash=_content_hash(docs),
        bad_records=tuple(bad.found),
    )


# ---------------------------------------------------------------------------- bad records


class _Bad(Exception):
    """A record or file that is not usable text. `name` is its Document name (relative path or
    file:line), `where` how an error message names it (full path, line)."""

    def __init__(self, name: str, where: str, reason: str):
        super().__init__(reason)
        self.name, self.where, self.reason = name, where, reason


class _BadRecords:
    """data.on_bad_record: "error" raises on the first bad record, "skip" collects them all."""

    def __init__(self, policy: str):
        if policy not in ("skip", "error"):
            raise ValueError(f"on_bad_record must be 'skip' or 'error', got {policy!r}")
        self.policy = policy
        self.found: list[str] = []

    def add(self, bad: _Bad) -> None:
        if self.policy == "error":
            raise DataError(f"{bad.where}: {bad.reason} (or set data.on_bad_record=skip to leave such records out)")
        self.found.append(f"{bad.name}: {bad.reason}")


# ---------------------------------------------------------------------------- candidates

# A candidate is (name, size in bytes, read) where read() returns the text or raises _Bad.
# Reading is deferred so a capped corpus only reads the files it keeps (and only finds bad
# files among those).
_Candidate = tuple[str, int, Callable[[], str]]


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
            out.append((rel, size, _text_reader(full, rel)))
    out.sort(key=lambda c: c[0])
    return out


def _text_reader(path: Path, name: str) -> Callable[[], str]:
    """Read `path` as UTF-8 text, or raise _Bad saying why it is not (binary, not UTF-8, unreadable)."""

    def read() -> str:
        try:
            data = path.read_bytes()
        except OSError as e:
            raise _Bad(name, str(path), f"cannot be read: {e.strerror or e}") from None
        nul = data.find(b"\x00")
        if nul >= 0:  # e.g. an image or a .pyc in a user directory
            raise _Bad(name, str(path), f"a binary file (NUL byte at byte {nul}), not text")
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as e:  # e.g. latin-1 text, or the stdlib's deliberately non-UTF-8 test files
            reason = f"not UTF-8 ({e.reason}, byte 0x{data[e.start]:02x} at byte {e.start})"
            raise _Bad(name, str(path), reason) from None

    return read


def _jsonl_records(path: Path, text_field: str, bad: _BadRecords) -> list[_Candidate]:
    """Every record of a .jsonl file; a line that is not a usable record goes to `bad`."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise DataError(f"data.source: {path} cannot be read: {e.strerror or e}") from None
    out: list[_Candidate] = []
    offset = 0
    for lineno, raw in enumerate(data.splitlines(keepends=True), start=1):
        start, offset = offset, offset + len(raw)
        try:
            text = _record_text(raw, start, text_field)
        except _NotARecord as e:
            bad.add(_Bad(f"{path.name}:{lineno}", f"{path}, line {lineno}", str(e)))
            continue
        if text:
            out.append((f"{path.name}:{lineno}", len(text.encode("utf-8")), lambda t=text: t))
    return out


class _NotARecord(ValueError):
    """Why one JSONL line is not a usable record."""


def _record_text(raw: bytes, start: int, text_field: str) -> str:
    """The text of the JSONL line `raw` (which starts at byte `start` of the file); '' for a blank line."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _NotARecord(f"not valid UTF-8 ({e.reason} at byte {start + e.start})") from None
    if start == 0:
        line = line.removeprefix("\ufeff")  # a byte-order mark some editors write
    if not line.strip():
        return ""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise _NotARecord(f"invalid JSON: {e.msg} (column {e.colno})") from None
    if not isinstance(record, dict):
        raise _NotARecord(f"expected a JSON object, got {_json_type(record)}")
    if text_field not in record:
        raise _NotARecord(
            f"record has no key {text_field!r} (set data.text_field; keys here: {', '.join(sorted(record)) or 'none'})"
        )
    text = record[text_field]
    if not isinstance(text, str):
        raise _NotARecord(f"{text_field!r} must be a string, got {_json_type(text)}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:  # JSON can spell one half of a surrogate pair ("\ud800"): not text
        char = f"U+{ord(text[e.start]):04X} at character {e.start}"
        raise _NotARecord(f"{text_field!r} holds a lone surrogate ({char})") from None
    return text


def _json_type(value: object) -> str:
    names = {
        dict: "an object",
        list: "an array",
        str: "a string",
        bool: "a boolean",
        int: "a number",
        float: "a number",
    }
    return "null" if value is None else names.get(type(value), type(value).__name__)


# ---------------------------------------------------------------------------- selection


def _spread_order(name: str) -> str:
    return hashlib.sha256(name.encode("utf-8")).hexdigest()


def _select(
    candidates: Iterable[_Candidate], bad: _BadRecords, *, max_bytes: int | None, max_files: int | None, source: str
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
        try:
            text = read()
        except _Bad as b:
            bad.add(b)
            continue
        if not text:
            continue
        docs.append(Document(name, text))
        total += len(text.encode("utf-8"))
    if not docs:
        raise _empty_corpus(candidates, bad, max_bytes, source)
    return docs


def _empty_corpus(candidates: list[_Candidate], bad: _BadRecords, max_bytes: int | None, source: str) -> DataError:
    """Why nothing was selected, said before a tokenizer would train on nothing."""
    smallest = min((c[1] for c in candidates), default=0)
    if max_bytes is not None and smallest > max_bytes:
        return DataError(
            f"data.max_bytes={max_bytes} is smaller than every document in {source!r} "
            f"(the smallest has {smallest} bytes)"
        )
    if bad.found:
        shown = "; ".join(bad.found[:3]) + ("; ..." if len(bad.found) > 3 else "")
        return DataError(
            f"data.source: no usable documents in {source!r}: skipped {len(bad.found)} bad record(s)/file(s): {shown}"
        )
    return DataError(f"data.source: no UTF-8 text documents found in {source!r}")


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
