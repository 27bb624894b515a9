"""Parallel layouts compute what the single process computes (gloo, several local processes).

Each layout trains the tiny model for 8 steps on global batches of 8 sequences and must log the
same losses as one process, step by step, within LOSS_TOL (fp32; measured differences are ~1e-6).
A checkpoint written by 4 ranks resumes on 2 ranks and on 1 and continues the same curve.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from canntrain_core.train.metrics import read_metrics

HERE = Path(__file__).parent
LOSS_TOL = 2e-4  # fp32 reductions in a different order; see the module docstring


def launch(nproc: int, out: Path, cache: str, *layouts: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(HERE / "dist_worker.py"), str(out), cache, *layouts]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir) if "loss" in r}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_cache):
    out = tmp_path_factory.mktemp("dist")
    sys.path.insert(0, str(HERE))
    from dist_worker import main

    main(str(out), data_cache, "single")  # the reference, in this process
    launch(2, out, data_cache, "dp2", "fsdp2", "zero2_2", "tp2", "pp2_gpipe", "pp2_1f1b")
    launch(4, out, data_cache, "fsdp2_tp2", "fsdp4@4")
    step4 = out / "fsdp4" / "checkpoints" / "step_4"
    launch(2, out, data_cache, f"fsdp2<{step4}")
    main(str(out), data_cache, f"single<{step4}")
    return out


@pytest.mark.parametrize("layout", ["dp2", "fsdp2", "zero2_2", "tp2", "pp2_gpipe", "pp2_1f1b", "fsdp2_tp2"])
def test_layout_matches_single_process(runs, layout):
    ref, got = losses(runs / "single"), losses(runs / layout)
    assert sorted(got) == sorted(ref) == list(range(1, 9))
    diffs = {s: abs(got[s] - ref[s]) for s in ref}
    assert max(diffs.values()) < LOSS_TOL, diffs
    ref_val = [r["val_loss"] for r in read_metrics(runs / "single") if "val_loss" in r]
    got_val = [r["val_loss"] for r in read_metrics(runs / layout) if "val_loss" in r]
    assert len(got_val) == len(ref_val) == 3
    assert max(abs(a - b) for a, b in zip(got_val, ref_val)) < LOSS_TOL


@pytest.mark.parametrize("resumed", ["fsdp2_from_", "single_from_"])
def test_checkpoint_from_4_ranks_resumes_on_fewer(runs, resumed):
    ref = losses(runs / "single")
    four = losses(runs / "fsdp4")
    assert sorted(four) == [1, 2, 3, 4]
    run_dir = next(p for p in runs.iterdir() if p.name.startswith(resumed))
    got = losses(run_dir)
    assert sorted(got) == [5, 6, 7, 8]
    assert max(abs(got[s] - ref[s]) for s in got) < LOSS_TOL, (got, ref)
