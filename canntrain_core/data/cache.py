"""Cache plumbing shared by the data steps: where the cache lives, content keys, atomic writes, locks.

Every cached artifact (a trained tokenizer, a pretokenized corpus) is named by a hash of
everything that determines its content, so a changed input simply misses the cache. Files are
written to a temporary name and renamed into place, so a crash never leaves a half-written
artifact that a later run would trust. Ranks started together (torchrun) take a file lock, so one
of them builds and the others find the result.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Iterator

from canntrain_core.errors import BadInput

try:  # POSIX only; elsewhere ranks may build the same artifact twice, which is wasteful but safe.
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]


class DataError(BadInput, ValueError):
    """A data problem the user can fix; the message names the recipe key or the file and line."""


def resolve_cache_dir(cache_dir: str | None) -> Path:
    """data.cache_dir, else $CANNTRAIN_CACHE, else ~/.cache/canntrain."""
    chosen = cache_dir or os.environ.get("CANNTRAIN_CACHE") or "~/.cache/canntrain"
    return Path(chosen).expanduser()


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def key_of(fields: dict[str, Any]) -> str:
    """A short, stable cache key for a dict of JSON-able fields (key order does not matter)."""
    return sha256_text(json.dumps(fields, sort_keys=True, separators=(",", ":")))[:20]


def atomic_write_text(path: Path, text: str) -> None:
    """Write `text` to `path` via a temporary file in the same directory, then rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on `path` (created if needed) for the duration of the block."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        if fcntl is not None:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            if fcntl is not None:
                fcntl.flock(f.fileno(), fcntl.LOCK_UN)
