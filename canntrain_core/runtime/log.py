"""canntrain's logger: ``logging.getLogger("canntrain")`` and its children, one per module (:func:`get_logger`).

What the library says about a run (the model and tokenizer it started from, a resume, a gradient-norm spike) goes
through it instead of ``print``: information as plain lines on standard output from rank 0 only, warnings and
errors on standard error from every rank. Silence or redirect it as any logger,
``logging.getLogger("canntrain").setLevel(logging.WARNING)``. The streams are looked up at each line, so a notebook
cell, pytest's capture or papermill's sees them; commands print their own results (tables, paths) to stdout.
"""

from __future__ import annotations

import logging
import sys

import torch.distributed as dist

ROOT = "canntrain"


class _RankZero(logging.Filter):
    """Information from rank 0 only (every rank says the same); warnings and errors from every rank."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.WARNING:
            return True
        return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


class _CurrentStream(logging.StreamHandler):
    """A handler writing to whatever sys.stdout (information) or sys.stderr (warnings) is when a line is logged."""

    def __init__(self):
        super().__init__()

    @property
    def stream(self):
        return sys.stderr if getattr(self, "_level", logging.INFO) >= logging.WARNING else sys.stdout

    @stream.setter
    def stream(self, value) -> None:  # logging.StreamHandler sets it in __init__; the property decides
        pass

    def emit(self, record: logging.LogRecord) -> None:
        self._level = record.levelno
        super().emit(record)


def _configure() -> logging.Logger:
    root = logging.getLogger(ROOT)
    if not any(isinstance(h, _CurrentStream) for h in root.handlers):
        handler = _CurrentStream()
        handler.setFormatter(logging.Formatter("%(message)s"))
        handler.addFilter(_RankZero())
        root.addHandler(handler)
        root.setLevel(logging.INFO)
        root.propagate = False  # a root logger's handler would print each line twice
    return root


def get_logger(name: str) -> logging.Logger:
    """The logger of module ``name`` (``__name__``), under canntrain's."""
    _configure()
    return logging.getLogger(f"{ROOT}.{name.removeprefix('canntrain_core.')}")
