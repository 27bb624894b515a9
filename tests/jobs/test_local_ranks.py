"""jobs/local_ranks.py: ranks forked from one import join a gloo job by torchrun's environment; a failing rank ends
the job, named with its output, without waiting for the others."""

import json
import time

import pytest

import _local_rank_targets as targets
from canntrain_core.jobs.local_ranks import RanksFailed, run_local_ranks


@pytest.mark.slow
def test_ranks_get_torchruns_environment_and_reduce_together(tmp_path, monkeypatch):
    monkeypatch.setenv("CALLER_SET", "yes")  # set after any earlier launch started the server: still seen
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.chdir(tmp_path)
    outputs = run_local_ranks(targets.sum_ranks, (str(tmp_path),), 3, tmp_path / "logs")
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]
    for rank, s in enumerate(seen):
        assert s["RANK"] == s["LOCAL_RANK"] == str(rank)
        assert s["WORLD_SIZE"] == s["LOCAL_WORLD_SIZE"] == "3"
        assert s["total"] == 6.0  # 1 + 2 + 3 over gloo
        assert s["OMP_NUM_THREADS"] == "1" and s["threads"] == 1  # torchrun's default for several ranks
        assert s["CALLER_SET"] == "yes" and s["cwd"] == str(tmp_path)
    assert [o.strip() for o in outputs] == [f"rank {r} says hello" for r in range(3)]
    assert (tmp_path / "logs" / "rank2.log").read_text().strip() == "rank 2 says hello"


@pytest.mark.slow
def test_a_failing_rank_is_named_with_its_output_and_the_others_are_stopped(tmp_path):
    began = time.monotonic()
    with pytest.raises(RanksFailed) as err:
        run_local_ranks(targets.fail_on, (1, 120.0), 2, tmp_path / "logs")
    assert time.monotonic() - began < 60  # rank 0 would have slept 120 s
    said = str(err.value)
    assert said.startswith("rank 1 of 2 exited with code 1")
    assert "rank 1 is about to fail" in said and "ValueError: deliberate failure on rank 1" in said


@pytest.mark.slow
def test_a_job_past_its_timeout_is_stopped_and_named(tmp_path):
    with pytest.raises(RanksFailed, match=r"rank 0 of 2 ran past 3 s"):
        run_local_ranks(targets.fail_on, (-1, 120.0), 2, tmp_path / "logs", timeout=3)
