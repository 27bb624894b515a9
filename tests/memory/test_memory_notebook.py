"""The memory-estimation notebook is committed clean: parameters cell first, no outputs.

Its execution is checked with nbmake:
    .venv/bin/python -m pytest --nbmake cookbook/llama/memory_estimation.ipynb
"""

from __future__ import annotations


import nbformat
from conftest import ROOT

NB = ROOT / "cookbook" / "llama" / "memory_estimation.ipynb"


def test_notebook_is_committed_without_outputs_and_first_code_cell_is_parameters():
    nb = nbformat.read(NB, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert "parameters" in code[0].metadata.get("tags", [])
    assert all(not c.outputs and c.execution_count is None for c in code)
    # logic lives in the core package: the notebook only imports from it
    assert not any(line.lstrip().startswith(("def ", "class ")) for c in code for line in c.source.splitlines())
