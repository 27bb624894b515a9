"""pytest plugin (pyproject addopts): a notebook nbmake runs also fails when its output shows a warning.

A reader cannot act on a warning printed from inside torch or transformers, so the notebooks must not
show any: silence them where they arise, in canntrain_core, or fix their cause. nbmake discards the
executed notebook, so its ``execute`` is wrapped to look at the outputs first.
"""

from __future__ import annotations

import re

import nbmake.nb_run as nb_run
from nbmake.nb_result import NotebookError

WARNING = re.compile(r"\b[A-Z]\w*Warning\b")


def warnings_in(nb) -> list[tuple[int, str]]:
    """(cell index, line) of every warning line a code cell printed."""
    found = []
    for i, cell in enumerate(nb.cells):
        for out in cell.get("outputs", []):
            text = out.get("text", "") if out.get("output_type") == "stream" else ""
            found += [(i, line.strip()) for line in text.splitlines() if WARNING.search(line)]
    return found


_execute = nb_run.NotebookRun.execute


def _execute_and_check(self, *args, **kwargs):
    result = _execute(self, *args, **kwargs)
    found = warnings_in(result.nb) if result.error is None else []
    if found:
        lines = "\n".join(f"cell {i}: {line}" for i, line in found)
        result.error = NotebookError(
            summary=f"{len(found)} warning(s) in the output", trace=lines, failing_cell_index=found[0][0]
        )
    return result


nb_run.NotebookRun.execute = _execute_and_check
