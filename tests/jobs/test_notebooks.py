"""Notebook hygiene (parameters cell, no committed outputs) and headless runs through papermill."""

import subprocess
import sys

import nbformat
import pytest

from canntrain_core.train.metrics import read_metrics
from nb_warnings import warnings_in
from conftest import ROOT

NOTEBOOKS = sorted((ROOT / "cookbook").rglob("*.ipynb"))
NOTEBOOKS = [p for p in NOTEBOOKS if ".ipynb_checkpoints" not in p.parts and "runs" not in p.parts]


def test_cookbook_has_the_core_notebooks():
    names = {p.relative_to(ROOT / "cookbook").as_posix() for p in NOTEBOOKS}
    assert {"00_quickstart.ipynb", "llama/pretrain.ipynb", "llama/resume.ipynb"} <= names


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_parameters_cell_first_and_no_outputs(path):
    nb = nbformat.read(path, as_version=4)
    code_cells = [c for c in nb.cells if c.cell_type == "code"]
    assert code_cells, "a notebook without code"
    assert "parameters" in code_cells[0].metadata.get("tags", []), "first code cell must be tagged `parameters`"
    for i, cell in enumerate(code_cells):
        assert not cell.outputs, f"code cell {i} has committed outputs"
        assert cell.execution_count is None, f"code cell {i} has an execution count"


def _canntrain(*args, cwd=ROOT):
    return subprocess.run(
        [sys.executable, "-m", "canntrain_core.cli", *args], cwd=cwd, capture_output=True, text=True, timeout=600
    )


class _Ran:
    def __init__(self, returncode: int, captured):
        self.returncode, self.stdout, self.stderr = returncode, captured.out, captured.err


def _canntrain_here(capfd, *args) -> _Ran:
    """The command line in this process (papermill still starts the notebook's own kernel)."""
    from canntrain_core.cli import main

    capfd.readouterr()
    rc = main(list(args))
    return _Ran(rc, capfd.readouterr())


def test_papermill_quickstart_run_dir_is_complete(tmp_path, capfd):
    run_dir = tmp_path / "quick"
    proc = _canntrain_here(
        capfd,
        "run",
        str(ROOT / "cookbook" / "00_quickstart.ipynb"),
        "-p",
        "max_steps",
        "40",
        "-p",
        "overrides",
        "{logging.eval_interval: 20, logging.ckpt_interval: 20}",
        "--run-dir",
        str(run_dir),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (run_dir / "00_quickstart.ipynb").is_file()
    assert (run_dir / "recipe.resolved.yaml").is_file() and (run_dir / "plots" / "loss.png").is_file()
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_20", "step_40"]
    rows = read_metrics(run_dir)
    vals = [r["val_loss"] for r in rows if "val_loss" in r]
    assert [r["step"] for r in rows if "val_loss" in r] == [0, 20, 40]
    assert vals[-1] < vals[0] - 1.0, vals  # the loss fell by more than a nat
    assert "final train loss" in proc.stdout and str(run_dir) in proc.stdout
    # The executed notebook carries outputs, the parameters papermill injected among them.
    executed = nbformat.read(run_dir / "00_quickstart.ipynb", as_version=4)
    assert warnings_in(executed) == []  # what nbmake checks of every other notebook (it skips this one)
    injected = [c for c in executed.cells if "injected-parameters" in c.metadata.get("tags", [])]
    assert injected and "max_steps = 40" in injected[0].source


def test_failing_cell_is_named(tmp_path, capfd):
    nb = nbformat.v4.new_notebook(
        cells=[
            nbformat.v4.new_code_cell("x = 1", metadata={"tags": ["parameters"]}),
            nbformat.v4.new_code_cell("y = 2"),
            nbformat.v4.new_code_cell("raise ValueError('the data path is wrong')"),
        ]
    )
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    path = tmp_path / "broken.ipynb"
    nbformat.write(nb, path)
    proc = _canntrain_here(capfd, "run", str(path), "--run-dir", str(tmp_path / "out"))
    assert proc.returncode != 0
    assert "ValueError: the data path is wrong" in proc.stderr
    assert "cell" in proc.stderr and str(tmp_path / "out" / "broken.ipynb") in proc.stderr


def test_notebook_runs_once_per_rank_under_torchrun(tmp_path):
    run_dir = tmp_path / "ranks"
    proc = _canntrain(
        "run",
        "cookbook/00_quickstart.ipynb",
        "--nproc_per_node",
        "2",
        "--run-dir",
        str(run_dir),
        "-p",
        "max_steps",
        "4",
        "-p",
        "overrides",
        "{distributed.world_size: 2, distributed.data_parallel_size: 2, "
        "data.batch_size: 4, logging.log_interval: 1, logging.eval_batches: 1}",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (run_dir / "00_quickstart.ipynb").is_file() and (run_dir / "ranks" / "rank1.ipynb").is_file()
    rows = read_metrics(run_dir)  # written once, by rank 0, for the two-rank job
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4]
    rank1 = nbformat.read(run_dir / "ranks" / "rank1.ipynb", as_version=4)
    printed = "".join(o.get("text", "") for c in rank1.cells if c.cell_type == "code" for o in c.outputs)
    assert "world 2 = tp 1 x pp 1 x dp 2" in printed
