"""`canntrain sweep`: a grid of papermill runs of one notebook, each in its own run directory, and a summary that
keeps a row for a run that failed while the others went on."""

from __future__ import annotations

import csv

import nbformat
import pytest

from canntrain_core.cli import main
from canntrain_core.errors import BadInput
from canntrain_core.jobs.notebook_sweep import parse_grid


def _notebook(path):
    """Logs loss = 1 / x into its run directory's metrics.jsonl; x = 2 fails in its second cell."""
    nb = nbformat.v4.new_notebook()
    params = nbformat.v4.new_code_cell("x = 1\nrun_dir = None")
    params.metadata["tags"] = ["parameters"]
    nb.cells = [
        params,
        nbformat.v4.new_code_cell(
            "import json, pathlib\n"
            "pathlib.Path(run_dir, 'metrics.jsonl').write_text(json.dumps({'step': 1, 'loss': 1 / x}) + '\\n')"
        ),
        nbformat.v4.new_code_cell("assert x != 2, 'x = 2 is the broken setting'"),
    ]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, path)
    return path


def test_a_sweep_of_three_runs_summarises_three_rows_and_survives_the_failing_one(tmp_path, capsys):
    nb = _notebook(tmp_path / "grid.ipynb")
    assert main(["sweep", str(nb), "-p", "x", "1,2,4", "--out", str(tmp_path / "sweep")]) == 1
    with open(tmp_path / "sweep" / "summary.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["run"], r["status"]) for r in rows] == [("x=1", "ok"), ("x=2", "failed"), ("x=4", "ok")]
    assert [float(r["loss"]) for r in rows] == [1.0, 0.5, 0.25]  # the failed run logged before its failing cell
    assert "x = 2 is the broken setting" in rows[1]["error"]
    assert all((tmp_path / "sweep" / r["run"] / "grid.ipynb").is_file() for r in rows)  # each executed copy
    assert "1 of 3 runs failed: x=2" in capsys.readouterr().out
    assert (tmp_path / "sweep" / "summary.md").read_text().count("\n") == 2 + 3


def test_a_grid_names_its_mistakes():
    assert parse_grid([("lr", "1e-3,3e-3"), ("steps", "20")]) == {"lr": [1e-3, 3e-3], "steps": [20]}
    with pytest.raises(BadInput, match="-p lr: given twice"):
        parse_grid([("lr", "1e-3"), ("lr", "3e-3")])
    with pytest.raises(BadInput, match="nothing to sweep"):
        parse_grid([])
