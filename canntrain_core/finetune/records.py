"""Instruction data in the JSONL formats people already have, read into one shape: a conversation.

One record per line, in any of:

- alpaca:   ``{"instruction": ..., "input": ... (optional), "output": ..., "system": ... (optional)}``
- messages: ``{"messages": [{"role": "system"|"user"|"assistant", "content": ...}, ...]}``
- ShareGPT: ``{"conversations": [{"from": "system"|"human"|"gpt", "value": ...}, ...]}``

A conversation must end with an assistant turn that is not empty (that is what trains and what an
evaluation scores). A line that is not such a record is reported as ``file, line N: why``; with
``data.on_bad_record: skip`` it is left out and counted instead.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from canntrain_core.data.cache import DataError

ROLES = ("system", "user", "assistant")
_SHAREGPT = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}


@dataclass(frozen=True)
class Conversation:
    name: str  # "file.jsonl:LINE"
    turns: tuple[tuple[str, str], ...]  # (role, content), ending with the assistant's answer

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
    """``parse(name, record)`` of every line of the JSONL file ``path`` (``what`` it holds, for the errors), and
    "file:line: why" for each line left out. The one bad-record policy of the instruction and preference
    data: a line that is not UTF-8 JSON, or that ``parse`` refuses with a :class:`BadRecord`, stops the run
    naming file and line (``data.on_bad_record: error``) or is left out and counted (``skip``); blank lines
    are ignored; a file with nothing usable is an error either way."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"data.source: {path} does not exist ({what} are a .jsonl file)")
    out, bad = [], []
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                try:
                    record = json.loads(raw.decode("utf-8"))
                except UnicodeDecodeError as e:
                    raise BadRecord(f"not valid UTF-8 ({e.reason})") from None
                except json.JSONDecodeError as e:
                    raise BadRecord(f"invalid JSON: {e.msg} (column {e.colno})") from None
                out.append(parse(f"{path.name}:{lineno}", record))
            except BadRecord as e:
                if on_bad_record == "error":
                    raise DataError(
                        f"{path}, line {lineno}: {e} (or set data.on_bad_record=skip to leave such records out)"
                    ) from None
                bad.append(f"{path.name}:{lineno}: {e}")
    if not out:
        raise DataError(f"{path}: no usable {what} ({len(bad)} left out: {'; '.join(bad[:3])})")
    return out, bad


def read_conversations(
    path: str | Path, fmt: str = "auto", on_bad_record: str = "error"
) -> tuple[list[Conversation], list[str]]:
    """Every conversation of a JSONL file, and "file:line: why" for each line left out (:func:`read_records`)."""
    return read_records(
        path, lambda name, record: Conversation(name, parse_record(record, fmt)), "instruction records", on_bad_record
    )
