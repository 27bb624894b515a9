"""canntrain doctor: the checks as functions (bus bandwidth factors, loopback MASTER_ADDR, the rank map, the recipe's
world size), one process in-process, and two 2-process torchrun launches (~20 s): a healthy one whose report lists
every group, op and size, and one with a rank that starts 20 s late, named within the 4 s timeout."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest
import torch.distributed as dist

from canntrain_core.cli import main
from canntrain_core.jobs.doctor import (
    cann_version,
    is_loopback,
    local_rank_problems,
    loopback_problems,
    rank_map_problems,
    rank_table_problems,
)
from canntrain_core.jobs.doctor_comm import KEY, RankDidNotAnswer, Timing, bus_factor, ranks_text, reach_round, sizes
from canntrain_core.recipe import load_recipe
from canntrain_core.runtime.rank_table import build_rank_table
from conftest import ROOT, TINY

TP2 = ["--set", "distributed.world_size=2", "--set", "distributed.tensor_parallel_size=2"]


def _rows(hosts: list[str], master: str = "localhost", local_world: int | None = None) -> list[dict]:
    """Rank-map rows: ranks numbered node by node, local ranks 0..k-1 per host."""
    rows, seen = [], {}
    for rank, host in enumerate(hosts):
        local = seen[host] = seen.get(host, -1) + 1
        rows.append(
            {
                "rank": rank,
                "host": host,
                "pid": 100 + rank,
                "local_rank": local,
                "local_world": local_world or hosts.count(host),
                "device": "cpu",
                "master_addr": master,
            }
        )
    return rows


# --------------------------------------------------------------------------- the checks


def test_bus_bandwidth_factors_are_nccl_tests():
    assert bus_factor("all_reduce", 2) == 1.0 and bus_factor("all_reduce", 8) == 1.75
    assert bus_factor("all_gather", 2) == 0.5 and bus_factor("all_gather", 8) == 0.875
    assert bus_factor("all_to_all", 4) == 0.75
    t = Timing("tp", [0, 1, 2, 3], "all_reduce", 4 * 1024**2, 1e-3, False)
    assert t.algbw == pytest.approx(4 * 1024**2 / 1e-3) and t.busbw == pytest.approx(t.algbw * 1.5)
    assert sizes(4 * 1024**2) == [4096, 16384, 65536, 262144, 1048576, 4194304] and sizes(1000) == [1000]
    assert ranks_text([0, 1, 2, 3]) == "0-3" and ranks_text([0, 2, 4]) == "0,2,4" and ranks_text([0, 1]) == "0,1"


def test_loopback_master_addr_is_a_problem_only_on_several_nodes():
    for addr in ("localhost", "127.0.0.1", "127.0.1.1", "::1", "[::1]"):
        assert is_loopback(addr, resolve=False), addr
    assert not is_loopback("10.0.0.1", resolve=False) and not is_loopback("node-7", resolve=False)

    assert loopback_problems(_rows(["a", "a"])) == []  # one node: localhost is right
    (line,) = loopback_problems(_rows(["a", "a", "b", "b"]))
    assert line.startswith("MASTER_ADDR=localhost (ranks 0, 1, 2, 3) is a loopback address on a multi-node job")
    assert "the other nodes cannot reach it" in line
    # one hostname on both nodes (containers), but WORLD_SIZE > LOCAL_WORLD_SIZE says two nodes
    assert loopback_problems(_rows(["c"] * 4, master="127.0.0.1", local_world=2))
    assert loopback_problems(_rows(["a", "a", "b", "b"], master="10.0.0.1")) == []


def test_a_round_names_the_rank_that_did_not_reach_it():
    store = dist.HashStore()
    store.set(f"{KEY}/round/tp/2", "1")  # rank 2 is there, rank 1 is not
    with pytest.raises(RankDidNotAnswer, match=r"^rank 1 did not reach the tp round within 0.2 s \(rank 0 waited\)"):
        reach_round(store, "tp", 0, [0, 1, 2], 0.2)
    store.set(f"{KEY}/round/tp/1", "1")
    reach_round(store, "tp", 0, [0, 1, 2], 0.2)


def test_local_ranks_per_host():
    assert local_rank_problems(_rows(["a", "a", "b", "b"])) == []
    rows = _rows(["a", "a"])
    rows[1]["local_rank"] = 0
    (line,) = [p for p in local_rank_problems(rows) if "LOCAL_RANKs" in p]
    assert line.startswith("host a: LOCAL_RANKs [0, 0], expected 0..1 once each (0 twice")


def test_world_size_mismatch_names_the_key_and_the_file():
    recipe = load_recipe(TINY, ["distributed.world_size=4", "distributed.data_parallel_size=4"])
    problems = rank_map_problems(_rows(["a", "a"]), recipe, str(TINY))
    assert problems == [
        f"distributed.world_size=4 in {TINY} but this job has 2 process(es) (WORLD_SIZE): launch with "
        "--nproc_per_node/--nnodes to match, or --set distributed.world_size=2"
    ]
    assert rank_map_problems(_rows(["a", "a"]), load_recipe(TINY, TP2[1::2]), str(TINY)) == []


def test_rank_table_and_cann_version(tmp_path, monkeypatch):
    rt = tmp_path / "rank_table.json"
    rt.write_text(json.dumps(build_rank_table(["10.0.0.1"], 1)))
    assert rank_table_problems(str(rt), 2) == [
        f"RANK_TABLE_FILE {rt}: world size: the table has 1 devices but --world-size is 2"
    ]
    info = tmp_path / "8.0.RC1" / "aarch64-linux" / "ascend_toolkit_install.info"
    info.parent.mkdir(parents=True)
    info.write_text("package_name=Ascend-cann-toolkit\nversion=8.0.RC1\narch=aarch64\n")
    monkeypatch.setenv("ASCEND_TOOLKIT_HOME", str(info.parent.parent))
    assert cann_version() == f"8.0.RC1 ({info})"


def test_one_process_reports_the_environment_only(monkeypatch, capfd):
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("CANNTRAIN_DEVICE", "cpu")
    assert main(["doctor", str(TINY), *TP2]) == 0
    out = capfd.readouterr().out
    assert re.search(r"^  torch_npu +\S", out, re.M) and re.search(r"^  HCCL_CONNECT_TIMEOUT +unset$", out, re.M)
    assert "collectives: not tested (one process; the recipe runs 2)" in out and "doctor: 0 problem(s)" in out

    # launched (WORLD_SIZE set) as one process for a 2-process recipe: a problem, exit 1, one line on stderr
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert main(["doctor", str(TINY), *TP2]) == 1
    captured = capfd.readouterr()
    assert "doctor: 1 problem(s)\n  - distributed.world_size=2 in" in captured.out
    assert captured.err.startswith("canntrain doctor: 1 problem(s): distributed.world_size=2 in ")


# --------------------------------------------------------------------------- launches


def _doctor(*args: str, tmp_path) -> tuple[subprocess.CompletedProcess, float]:
    """Launch the doctor on 2 ranks; also the seconds from the first stdout line naming a late rank to the end."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    cmd += ["-m", "canntrain_core.cli", "doctor", str(TINY), *TP2, *args]
    env = {**os.environ, "CANNTRAIN_DEVICE": "cpu", "OMP_NUM_THREADS": "1"}
    late = None
    with open(tmp_path / "stderr", "w+") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, cwd=ROOT, env=env)
        out = []
        for line in proc.stdout:  # read as it comes, to time when the late rank said so
            out.append(line)
            if late is None and "s late (--delay-rank" in line:
                late = time.monotonic()
        proc.wait(timeout=120)
        err.seek(0)
        r = subprocess.CompletedProcess(cmd, proc.returncode, "".join(out), err.read())
    return r, (time.monotonic() - late if late else float("nan"))


@pytest.mark.slow
def test_two_ranks_report_every_group_op_and_size(tmp_path):
    r, _ = _doctor("--timeout", "30", "--max-bytes", "64KiB", tmp_path=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    for rank in (0, 1):
        assert re.search(rf"^  {rank} +\S+ +\d+ +{rank} +cpu$", r.stdout, re.M), r.stdout
    assert "\nmesh: tp 2\n" in r.stdout
    for group in ("world", "tp"):
        for op in ("all_reduce", "all_gather", "all_to_all"):
            for size in ("4.0 KiB", "16.0 KiB", "64.0 KiB"):
                row = rf"^  {group} +0,1 +{op} +{size} +[\d.]+ [um]?s +[\d.]+ GB/s +[\d.]+ GB/s +ok$"
                assert re.search(row, r.stdout, re.M), (row, r.stdout)
    assert r.stdout.rstrip().endswith("doctor: 0 problem(s)")


@pytest.mark.slow
def test_a_late_rank_is_named_and_nobody_waits_for_it(tmp_path):
    r, after = _doctor("--timeout", "4", "--delay-rank", "1", "--delay-seconds", "20", tmp_path=tmp_path)
    assert r.returncode != 0, r.stdout + r.stderr[-3000:]
    line = "canntrain doctor: rank 1 of 2 did not arrive within 4 s: never started or stuck before the doctor"
    assert line in r.stderr, r.stderr[-3000:]
    assert "doctor: rank 1 starts 20 s late (--delay-rank, a rehearsal)" in r.stdout
    # the job ended well before rank 1's 20 s were up: rank 0 gave up after 4 s and torchrun ended rank 1
    assert after < 15, f"the job ended {after:.0f} s after rank 1 began its 20 s delay: it waited for the late rank"
