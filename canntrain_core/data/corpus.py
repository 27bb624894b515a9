"""Raw text sources, read as a stream of documents: what ``canntrain prepare`` and the in-process preparation
of a tiny recipe's corpus read. Nothing here holds a corpus in memory.

A source is ``stdlib`` (the interpreter's own standard library: ships everywhere, nothing is downloaded at run time),
a directory, a file or a glob of them. Inside, by file name:

==========================================  =====================================================
``*.jsonl``, ``*.jsonl.gz``, ``*.jsonl.zst``  one JSON object per line, the text under ``text_field``
``*.parquet``                                 one row per document, the text in column ``text_field``
a ``datasets`` directory (``save_to_disk``)   rows of an Arrow dataset, read by ``datasets.load_from_disk``
any other file                                one document: the file's text (UTF-8)
==========================================  =====================================================

The work is cut into :class:`Unit` s of about ``unit_bytes``: groups of small files, byte ranges of a large
``.jsonl``, row groups of a Parquet file, row ranges of an Arrow dataset (a compressed file is one unit: its
stream cannot be entered in the middle). Units depend only on the inputs, never on how many workers read them,
so a preparation is the same whatever ran it. Listing costs a ``stat`` per file and a Parquet footer per
Parquet file; no document is read until a unit is.

A record that is not usable text is named by file and line (row) and stops the work, or with
``on_bad_record="skip"`` is left out and counted (:class:`BadRecords`).
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import io
import json
import os
import stat
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import zstandard

from canntrain_core.data.cache import DataError

# Directories never part of a corpus: installed packages are not "the standard library",
# and caches / VCS metadata are not text anyone wrote.
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}
RECORD_SUFFIXES = {".jsonl": "jsonl", ".jsonl.gz": "jsonl", ".jsonl.zst": "jsonl", ".parquet": "parquet"}
SUPPORTED = "'stdlib', a directory, a .jsonl / .jsonl.gz / .jsonl.zst / .parquet file, a datasets directory or a glob"
_BATCH_ROWS = 1024  # rows per Arrow batch: bounded memory, few Python calls


def stdlib_dir() -> Path:
    """The running interpreter's standard-library directory."""
    return Path(sysconfig.get_paths()["stdlib"])


@dataclass(frozen=True)
class Input:
    """One input: a text file (one document), a record file, or a ``datasets`` directory."""

    path: str  # absolute
    kind: str  # "text" | "jsonl" | "parquet" | "arrow"
    name: str  # how its documents are named in messages: relative path (text) or file name
    size: int  # bytes on disk (arrow: its .arrow files)
    mtime_ns: int
    rows: int = 0  # parquet / arrow: rows; parquet also groups (row counts per row group, for units)
    row_groups: tuple[int, ...] = ()


@dataclass(frozen=True)
class Unit:
    """A piece of work: ``inputs`` (indices into the listing) whole, or one input's ``[lo, hi)``: bytes of a
    plain .jsonl, row groups of a Parquet file, rows of an Arrow dataset. ``nbytes`` estimates its text."""

    inputs: tuple[int, ...]
    lo: int = 0
    hi: int = -1
    nbytes: int = 0

    def to_json(self) -> list:
        return [list(self.inputs), self.lo, self.hi, self.nbytes]

    @classmethod
    def from_json(cls, v: list) -> "Unit":
        return cls(tuple(v[0]), v[1], v[2], v[3])


# ---------------------------------------------------------------------------- listing


def list_inputs(source: str | Path, what: str = "data source") -> list[Input]:
    """The inputs of one source, in a stable order (sorted paths); a DataError names it as ``what`` (the recipe
    key) and says what is wrong with it."""
    if str(source) == "stdlib":
        return _walk(stdlib_dir(), suffixes=(".py",))
    text = os.path.expanduser(str(source))
    if glob.has_magic(text):
        matches = sorted(glob.glob(text, recursive=True))
        if not matches:
            raise DataError(f"{what}: {str(source)!r} matches nothing (cwd {os.getcwd()})")
        return [i for m in matches for i in list_inputs(m, what)]
    path = Path(text)
    if not path.exists():
        raise DataError(f"{what}: {str(source)!r} does not exist (cwd {os.getcwd()}); expected {SUPPORTED}")
    path = path.resolve()
    if path.is_dir():
        if (path / "dataset_dict.json").is_file():
            splits = sorted(p.name for p in path.iterdir() if p.is_dir())
            raise DataError(
                f"{path}: a datasets DatasetDict; name one split's directory ({', '.join(splits) or 'none found'})"
            )
        if (path / "state.json").is_file() and (path / "dataset_info.json").is_file():
            return [_arrow_input(path)]
        return _walk(path, suffixes=None)
    kind = record_kind(path.name)
    if kind is None:
        raise DataError(f"{what}: {str(source)!r} is a file, but not a record file; expected {SUPPORTED}")
    return [_record_input(path, path.name, kind)]


def record_kind(filename: str) -> str | None:
    for suffix, kind in RECORD_SUFFIXES.items():
        if filename.endswith(suffix):
            return kind
    return None


def _walk(root: Path, suffixes: tuple[str, ...] | None) -> list[Input]:
    """Files under ``root`` in sorted relative-path order; hidden files and symlinked directories left out.
    One ``scandir`` per directory and one ``stat`` per file, on strings: the standard library's 1,800 files list in
    11 ms here, against 35 ms through pathlib (every trainer that reads ``stdlib`` lists it twice)."""
    out: list[Input] = []
    pending = [(str(root), "")]
    while pending:
        directory, rel = pending.pop()
        with os.scandir(directory) as entries:
            for entry in entries:
                name = entry.name
                if name.startswith("."):
                    continue
                if entry.is_dir(follow_symlinks=False):
                    if name not in _SKIP_DIRS:
                        pending.append((entry.path, rel + name + "/"))
                    continue
                if suffixes is not None and not name.endswith(suffixes):
                    continue
                try:
                    st = entry.stat()  # through a symlink: a link to a file is that file
                except OSError:  # a dangling link
                    continue
                if not stat.S_ISREG(st.st_mode) or st.st_size == 0:
                    continue  # a link to a directory, a device, an empty file
                kind = record_kind(name) if suffixes is None else None
                if kind is None:
                    out.append(Input(entry.path, "text", rel + name, st.st_size, st.st_mtime_ns))
                else:
                    out.append(_record_input(Path(entry.path), rel + name, kind))
    out.sort(key=lambda i: i.name)
    return out


def _record_input(path: Path, name: str, kind: str) -> Input:
    st = path.stat()
    if kind != "parquet":
        return Input(str(path), kind, name, st.st_size, st.st_mtime_ns)
    # deferred: start-up time (pyarrow, for Parquet inputs only; canntrain --help imports this module)
    import pyarrow.parquet as pq

    try:
        meta = pq.ParquetFile(path).metadata
    except Exception as e:  # pyarrow's ArrowInvalid / OSError for a file that is not Parquet
        raise DataError(f"{path}: not a readable Parquet file ({_short(e)})") from None
    groups = tuple(meta.row_group(g).num_rows for g in range(meta.num_row_groups))
    return Input(str(path), kind, name, st.st_size, st.st_mtime_ns, rows=meta.num_rows, row_groups=groups)


def _arrow_input(path: Path) -> Input:
    files = sorted(path.glob("*.arrow"))
    size = sum(f.stat().st_size for f in files)
    mtime = max((f.stat().st_mtime_ns for f in files), default=0)
    rows = len(_load_arrow(path))
    return Input(str(path), "arrow", path.name, size, mtime, rows=rows)


def _load_arrow(path: str | Path):
    # deferred: start-up time (datasets, ~0.5 s, for Arrow directories only; canntrain --help imports this module)
    import datasets

    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as e:  # datasets raises FileNotFoundError / ArrowInvalid / ValueError for broken dirs
        raise DataError(f"{path}: datasets cannot load it ({_short(e)})") from None
    if not isinstance(ds, datasets.Dataset):
        raise DataError(f"{path}: not one datasets.Dataset (name one split's directory)")
    return ds


def listing_fingerprint(inputs: list[Input]) -> str:
    """sha256 of the inputs' paths, sizes and modification times: what a cache of their preparation is keyed by
    (an edited file changes it; nothing is read)."""
    h = hashlib.sha256()
    for i in inputs:
        h.update(f"{i.path}\t{i.size}\t{i.mtime_ns}\n".encode("utf-8", "surrogateescape"))
    return h.hexdigest()


def spread_order(name: str) -> str:
    """The order a size cap visits inputs in: by sha256 of the name, so that a small cap still sees a bit of
    every corner (the stdlib's ``zoneinfo`` as well as its ``abc.py``)."""
    return hashlib.sha256(name.encode("utf-8", "surrogateescape")).hexdigest()


def select(inputs: list[Input], max_bytes: int | None, max_files: int | None) -> list[Input]:
    """Under ``data.max_bytes`` / ``data.max_files``: the text files that fit, visited in :func:`spread_order`
    (a file too large for what is left is passed over, so the cap fills); record files are kept whole (their
    records are capped while reading). Sorted by name again afterwards."""
    if max_bytes is None and max_files is None:
        return inputs
    kept, total = [], 0
    for i in sorted(inputs, key=lambda i: spread_order(i.name)):
        if max_files is not None and len(kept) >= max_files:
            break
        if i.kind == "text":
            if max_bytes is not None and total + i.size > max_bytes:
                continue
            total += i.size
        kept.append(i)
    return sorted(kept, key=lambda i: i.name)


def make_units(inputs: list[Input], unit_bytes: int) -> list[Unit]:
    """Cut the inputs into units of about ``unit_bytes`` (see the module docstring)."""
    units: list[Unit] = []
    group: list[int] = []
    group_bytes = 0

    def flush() -> None:
        nonlocal group, group_bytes
        if group:
            units.append(Unit(tuple(group), nbytes=group_bytes))
            group, group_bytes = [], 0

    for k, i in enumerate(inputs):
        if i.kind == "text":
            group.append(k)
            group_bytes += i.size
            if group_bytes >= unit_bytes:
                flush()
            continue
        flush()
        if i.kind == "jsonl" and i.path.endswith(".jsonl") and i.size > unit_bytes:
            for lo in range(0, i.size, unit_bytes):
                units.append(Unit((k,), lo, min(lo + unit_bytes, i.size), min(unit_bytes, i.size - lo)))
        elif i.kind == "parquet" and i.row_groups:
            per_row = i.size / max(i.rows, 1)
            lo, acc = 0, 0
            for g, n in enumerate(i.row_groups):
                acc += n
                if acc * per_row >= unit_bytes or g == len(i.row_groups) - 1:
                    units.append(Unit((k,), lo, g + 1, int(acc * per_row)))
                    lo, acc = g + 1, 0
        elif i.kind == "arrow" and i.rows:
            per_row = i.size / i.rows
            step = max(1, int(unit_bytes / max(per_row, 1)))
            for lo in range(0, i.rows, step):
                hi = min(lo + step, i.rows)
                units.append(Unit((k,), lo, hi, int((hi - lo) * per_row)))
        elif i.kind != "parquet" and i.kind != "arrow":
            units.append(Unit((k,), 0, -1, i.size))
    flush()
    return units


# ---------------------------------------------------------------------------- bad records


class BadRecords:
    """``data.on_bad_record``: "error" stops at the first record that is not usable text, naming file and line;
    "skip" leaves it out, counts it and keeps the first few names."""

    def __init__(self, policy: str, keep: int | None = 10):
        if policy not in ("skip", "error"):
            raise ValueError(f"on_bad_record must be 'skip' or 'error', got {policy!r}")
        self.policy = policy
        self.keep = keep  # examples kept (None: all of them: instruction data, which is held in memory anyway)
        self.count = 0
        self.examples: list[str] = []

    def add(self, where: str, reason: str, name: str | None = None) -> None:
        """``where``: the file and line (row) an error names; ``name``: the shorter "file:line" a skip lists."""
        if self.policy == "error":
            raise DataError(
                f"{where}: {reason} (or set data.on_bad_record=skip, prepare's --on-bad-record skip, to leave such "
                "records out)"
            )
        self.count += 1
        if self.keep is None or len(self.examples) < self.keep:
            self.examples.append(f"{name or where}: {reason}")


# ---------------------------------------------------------------------------- reading


def read_unit(inputs: list[Input], unit: Unit, text_field: str, bad: BadRecords) -> Iterator[str]:
    """The texts of one unit's documents, in order (empty ones left out)."""
    if unit.hi == -1 and all(inputs[k].kind == "text" for k in unit.inputs):
        for k in unit.inputs:
            text = _read_text_file(inputs[k], bad)
            if text:
                yield text
        return
    (k,) = unit.inputs
    i = inputs[k]
    if i.kind == "jsonl":
        yield from (t for _, _, t in _jsonl_records(i, unit, text_field, bad, want_text=True))
    elif i.kind == "parquet":
        yield from _parquet_texts(i, unit, text_field, bad)
    else:
        yield from _arrow_texts(i, unit, text_field, bad)


def iter_records(source: str | Path, bad: BadRecords, what: str = "data.source") -> Iterator[tuple[str, str, dict]]:
    """Every record of a record source (instruction and preference data) as ``(name, where, dict)``: name
    "file:line" (or "file:row"), where "path, line N" (or "path, row N"). .jsonl (plain, .gz, .zst), Parquet or
    a datasets directory; a line that is not a JSON object goes to ``bad``."""
    inputs = list_inputs(source, what)
    for k, i in enumerate(inputs):
        if i.kind == "text":
            raise DataError(f"data.source: {i.path} is not a record file; records come as {SUPPORTED}")
        unit = Unit((k,), 0, len(i.row_groups) if i.kind == "parquet" else (i.rows if i.kind == "arrow" else -1))
        if i.kind == "jsonl":
            yield from _jsonl_records(i, unit, None, bad, want_text=False)
        else:
            yield from _arrow_rows(i, unit, None)


def _read_text_file(i: Input, bad: BadRecords) -> str:
    try:
        data = Path(i.path).read_bytes()
    except OSError as e:
        bad.add(i.path, f"cannot be read: {e.strerror or e}", i.name)
        return ""
    nul = data.find(b"\x00")
    if nul >= 0:  # e.g. an image or a .pyc in a user directory
        bad.add(i.path, f"a binary file (NUL byte at byte {nul}), not text", i.name)
        return ""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:  # e.g. latin-1 text, or the stdlib's deliberately non-UTF-8 test files
        bad.add(i.path, f"not UTF-8 ({e.reason}, byte 0x{data[e.start]:02x} at byte {e.start})", i.name)
        return ""


class _NotARecord(ValueError):
    """Why one JSONL line is not a usable record."""


class _ZstdLines(io.RawIOBase):
    """A .zst file's decompressed bytes, frame after frame; ending inside a frame is an error (zstandard's own
    stream reader returns a truncated file's bytes as if complete)."""

    def __init__(self, path: str):
        self._zstd = zstandard
        self._file = open(path, "rb")
        self._dobj = zstandard.ZstdDecompressor().decompressobj()
        self._pending = b""
        self._started = False  # bytes of the current frame were fed

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while not self._pending:
            chunk = self._file.read(1 << 20)
            if not chunk:
                if self._started and not self._dobj.eof:
                    raise EOFError("the file ends inside a zstd frame")
                return 0
            while chunk:
                self._started = True
                self._pending += self._dobj.decompress(chunk)
                chunk = b""
                if self._dobj.eof:  # a frame ended: the next one (if any) starts in unused_data
                    chunk = self._dobj.unused_data
                    self._dobj = self._zstd.ZstdDecompressor().decompressobj()
                    self._started = False
        n = min(len(buffer), len(self._pending))
        buffer[:n] = self._pending[:n]
        self._pending = self._pending[n:]
        return n

    def close(self) -> None:
        self._file.close()
        super().close()


def _open_jsonl(i: Input):
    if i.path.endswith(".gz"):
        return gzip.open(i.path, "rb")
    if i.path.endswith(".zst"):
        return io.BufferedReader(_ZstdLines(i.path), 1 << 20)
    return open(i.path, "rb")


def _jsonl_records(i: Input, unit: Unit, text_field: str | None, bad: BadRecords, want_text: bool):
    """(name, where, text or record) of each usable line of the unit's part of a JSONL input (names only for
    whole files: a unit that starts mid-file counts its lines only for a message)."""
    compressed = not i.path.endswith(".jsonl")
    try:
        f = _open_jsonl(i)
    except OSError as e:
        raise DataError(f"{i.path}: cannot be read: {e.strerror or e}") from None
    with f:
        pos, lineno = unit.lo, 1
        if unit.lo > 0:  # start at the first line that begins at or after lo
            f.seek(unit.lo - 1)
            skipped = f.readline()
            pos = unit.lo - 1 + len(skipped)
            lineno = None  # counted only if a message needs it
        while unit.hi == -1 or pos < unit.hi:
            try:
                raw = f.readline()
            except Exception as e:  # gzip: EOFError / BadGzipFile / zlib.error; zstandard.ZstdError
                if not compressed:
                    raise DataError(f"{i.path}: cannot be read ({_short(e)})") from None
                where = f"{i.path}, after line {lineno - 1}" if lineno and lineno > 1 else i.path
                raise DataError(f"{where}: the compressed stream is truncated or corrupt ({_short(e)})") from None
            if not raw:
                break
            start, pos = pos, pos + len(raw)
            try:
                value = _record(raw, start, text_field, want_text)
            except _NotARecord as e:
                line = lineno if lineno is not None else _line_number(i.path, start)
                bad.add(f"{i.path}, line {line}", str(e), f"{i.name}:{line}")
                value = None
            if value and want_text:
                yield "", "", value
            elif value:
                yield f"{i.name}:{lineno}", f"{i.path}, line {lineno}", value
            if lineno is not None:
                lineno += 1


def _line_number(path: str, offset: int) -> int:
    """1-based line of the byte at ``offset`` of a plain file (counted only when a message needs it)."""
    n = 1
    with open(path, "rb") as f:
        left = offset
        while left > 0:
            chunk = f.read(min(left, 1 << 24))
            if not chunk:
                break
            n += chunk.count(b"\n")
            left -= len(chunk)
    return n


def _record(raw: bytes, start: int, text_field: str | None, want_text: bool):
    """The text (``want_text``) or the whole record of one JSONL line; '' / None for a blank line."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _NotARecord(f"not valid UTF-8 ({e.reason} at byte {start + e.start})") from None
    if start == 0:
        line = line.removeprefix("\ufeff")  # a byte-order mark some editors write
    if not line.strip():
        return None
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise _NotARecord(f"invalid JSON: {e.msg} (column {e.colno})") from None
    if not isinstance(record, dict):
        raise _NotARecord(f"expected a JSON object, got {json_type(record)}")
    return record_text(record, text_field) if want_text else record


def record_text(record: dict, text_field: str) -> str:
    """``record[text_field]`` as usable text, or _NotARecord saying why not."""
    if text_field not in record:
        raise _NotARecord(
            f"record has no key {text_field!r} (set data.text_field, prepare's --text-field; keys here: "
            f"{', '.join(sorted(record)) or 'none'})"
        )
    text = record[text_field]
    if not isinstance(text, str):
        raise _NotARecord(f"{text_field!r} must be a string, got {json_type(text)}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:  # JSON can spell one half of a surrogate pair ("\ud800"): not text
        char = f"U+{ord(text[e.start]):04X} at character {e.start}"
        raise _NotARecord(f"{text_field!r} holds a lone surrogate ({char})") from None
    return text


def json_type(value: object) -> str:
    names = {
        dict: "an object",
        list: "an array",
        str: "a string",
        bool: "a boolean",
        int: "a number",
        float: "a number",
    }
    return "null" if value is None else names.get(type(value), type(value).__name__)


def _parquet_texts(i: Input, unit: Unit, text_field: str, bad: BadRecords) -> Iterator[str]:
    for name, where, row in _arrow_rows(i, unit, [text_field]):
        try:
            text = record_text(row, text_field)
        except _NotARecord as e:
            bad.add(where, str(e), name)
            continue
        if text:
            yield text


_arrow_texts = _parquet_texts


def _arrow_rows(i: Input, unit: Unit, columns: list[str] | None) -> Iterator[tuple[str, str, dict]]:
    """(name "file:N", where "path, row N", row as a dict) of the unit's rows of a Parquet file or an Arrow
    dataset (rows counted from 0)."""
    if i.kind == "parquet":
        # deferred: start-up time (pyarrow, for Parquet inputs only; canntrain --help imports this module)
        import pyarrow.parquet as pq

        try:
            pf = pq.ParquetFile(i.path)
            _check_columns(i, pf.schema_arrow.names, columns)
            groups = list(range(unit.lo, unit.hi))
            row = sum(i.row_groups[: unit.lo])
            batches = pf.iter_batches(batch_size=_BATCH_ROWS, row_groups=groups, columns=columns)
            for batch in batches:
                for r in batch.to_pylist():
                    yield f"{i.name}:{row}", f"{i.path}, row {row}", r
                    row += 1
        except DataError:
            raise
        except Exception as e:  # a damaged page: pyarrow's OSError / ArrowInvalid
            raise DataError(f"{i.path}: not a readable Parquet file ({_short(e)})") from None
        return
    ds = _load_arrow(i.path)
    _check_columns(i, ds.column_names, columns)
    if columns:
        ds = ds.select_columns(columns)
    row = unit.lo
    for batch in ds.select(range(unit.lo, unit.hi)).iter(batch_size=_BATCH_ROWS):
        keys = list(batch)
        for values in zip(*(batch[k] for k in keys)):
            yield f"{i.name}:{row}", f"{i.path}, row {row}", dict(zip(keys, values))
            row += 1


def _check_columns(i: Input, names: list[str], columns: list[str] | None) -> None:
    missing = [c for c in columns or () if c not in names]
    if missing:
        raise DataError(
            f"{i.path}: no column {missing[0]!r} (set data.text_field, prepare's --text-field; columns here: "
            f"{', '.join(names)})"
        )


def _short(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:200] if text else type(e).__name__


@dataclass
class SampleTexts:
    """Up to ``max_bytes`` of text spread over the units (each unit's first documents, in unit order): what a
    tokenizer is trained on when none is given. Bounded by the sample, never by the corpus."""

    texts: list[str] = field(default_factory=list)
    n_bytes: int = 0


def sample_texts(
    inputs: list[Input], units: list[Unit], text_field: str, bad: BadRecords, max_bytes: int
) -> SampleTexts:
    out = SampleTexts()
    share = max(1, max_bytes // max(len(units), 1))
    for unit in units:
        taken = 0
        for text in read_unit(inputs, unit, text_field, bad):
            n = len(text.encode("utf-8"))
            out.texts.append(text)
            out.n_bytes += n
            taken += n
            if taken >= share or out.n_bytes >= max_bytes:
                break
        if out.n_bytes >= max_bytes:
            break
    return out
