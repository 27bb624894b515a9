"""Instruction data in the record formats people already have, read into one shape: a conversation.

Records come from .jsonl (plain, .gz, .zst), Parquet files or a ``datasets`` directory (``data/corpus.py``
reads them), each in any of:

- alpaca:   ``{"instruction": ..., "input": ... (optional), "output": ..., "system": ... (optional)}``
- messages: ``{"messages": [{"role": "system"|"user"|"assistant", "content": ...}, ...]}``
- ShareGPT: ``{"conversations": [{"from": "system"|"human"|"gpt", "value": ...}, ...]}``

A conversation must end with an assistant turn that is not empty (that is what trains and what an
evaluation scores). A line that is not such a record is reported as ``file, line N: why``; with
``data.on_bad_record: skip`` it is left out and counted instead.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from canntrain_core.data.cache import DataError
from canntrain_core.data.corpus import BadRecords, iter_records
from canntrain_core.data.pipeline import source_names

ROLES = ("system", "user", "assistant")
_SHAREGPT = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}


@dataclass(frozen=True)
class Conversation:
    name: str  # "file.jsonl:LINE" (or "file.parquet:ROW")
    turns: tuple[tuple[str, str], ...]  # (role, content), ending with the assistant's answer
    where: str = ""  # "path, line N": how a message names it

    @property
    def answer(self) -> str:
        return self.turns[-1][1]


class BadRecord(ValueError):
    """Why one line is not a usable instruction record."""


def parse_record(record: object, fmt: str = "auto") -> tuple[tuple[str, str], ...]:
    """The (role, content) turns of one decoded JSON record; BadRecord says what is wrong."""
    if not isinstance(record, dict):
        raise BadRecord(f"expected a JSON object, got {type(record).__name__}")
    if fmt == "auto":
        fmt = "messages" if "messages" in record else "sharegpt" if "conversations" in record else "alpaca"
    if fmt == "alpaca":
        for key in ("instruction", "output"):
            if not isinstance(record.get(key), str):
                raise BadRecord(
                    f"alpaca record needs a string {key!r} (keys here: {', '.join(sorted(record)) or 'none'})"
                )
        prompt = record["instruction"] + (f"\n\n{record['input']}" if record.get("input") else "")
        turns = ([("system", record["system"])] if record.get("system") else []) + [
            ("user", prompt),
            ("assistant", record["output"]),
        ]
    else:
        key, role_key, text_key = (
            ("messages", "role", "content") if fmt == "messages" else ("conversations", "from", "value")
        )
        items = record.get(key)
        if not isinstance(items, list) or not items:
            raise BadRecord(f"{fmt} record needs a non-empty list {key!r}")
        turns = []
        for i, item in enumerate(items):
            role = item.get(role_key) if isinstance(item, dict) else None
            role = role if fmt == "messages" else _SHAREGPT.get(role)
            if role not in ROLES or not isinstance(item.get(text_key), str):
                raise BadRecord(
                    f"{key}[{i}]: needs {role_key!r} in "
                    f"{ROLES if fmt == 'messages' else tuple(_SHAREGPT)} and a string {text_key!r}"
                )
            turns.append((role, item[text_key]))
    if turns[-1][0] != "assistant":
        raise BadRecord("the last turn must be the assistant's (the answer to train on)")
    if not turns[-1][1].strip():
        raise BadRecord("empty answer")
    return tuple(turns)


def read_records(path: str | Path, parse, what: str, on_bad_record: str = "error") -> tuple[list, list[str]]:
    """``parse(name, where, record)`` of every record of ``path`` (``what`` it holds, for the errors), and
    "file:line: why" for each record left out. The one bad-record policy of the instruction and preference
    data: a line that is not UTF-8 JSON, or that ``parse`` refuses with a :class:`BadRecord`, stops the run
    naming file and line (``data.on_bad_record: error``) or is left out and counted (``skip``); blank lines
    are ignored; a source with nothing usable is an error either way."""
    bad = BadRecords(on_bad_record, keep=None)
    out = []
    for name, where, record in iter_records(path, bad):
        try:
            out.append(parse(name, where, record))
        except BadRecord as e:
            bad.add(where, str(e), name)
    if not out:
        raise DataError(f"{path}: no usable {what} ({bad.count} left out: {'; '.join(bad.examples[:3])})")
    return out, bad.examples


def read_conversations(
    path: str | Path, fmt: str = "auto", on_bad_record: str = "error"
) -> tuple[list[Conversation], list[str]]:
    """Every conversation of a JSONL file, and "file:line: why" for each line left out (:func:`read_records`)."""
    return read_records(
        path,
        lambda name, where, record: Conversation(name, parse_record(record, fmt), where),
        "instruction records",
        on_bad_record,
    )


def is_val(name: str, fraction: float) -> bool:
    """Whether the record named ``name`` ("file:line") is held out: by a hash of its name, so the split is the same
    on every machine and does not move when other records are added."""
    return int(hashlib.sha256(name.encode()).hexdigest()[:8], 16) / 2**32 < fraction


@dataclass
class SourceRecords:
    """One source of instruction or preference data: its name and weight (``data.sources``) and what was read."""

    name: str
    path: str
    weight: float
    items: list
    bad: list[str]


def read_sources(cfg, read) -> list[SourceRecords]:
    """``read(path)`` -> (items, bad) of every source of ``data.sources`` (or ``data.source`` alone)."""
    try:
        mixture = cfg.mixture
    except ValueError as e:
        raise DataError(str(e)) from None
    return [SourceRecords(n, s.path, s.weight, *read(s.path)) for n, s in zip(source_names(cfg), mixture)]
