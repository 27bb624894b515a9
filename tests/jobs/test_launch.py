"""Launch: HCCL rank table (write/check), Slurm rendering, scripts/run_pretrain.sh arguments,
and a failing rank ending a torchrun job with the rank named (one 2-process launch, ~5 s)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from canntrain_core.cli import main
from canntrain_core.jobs.slurm import SlurmError, SlurmJob, render
from canntrain_core.runtime.rank_table import PLACEHOLDER_KEY, build_rank_table, check_rank_table, load_device_ips
from conftest import ROOT

SCRIPT = ROOT / "scripts" / "run_pretrain.sh"
TINY = ROOT / "cookbook" / "llama" / "configs" / "tiny_pretrain.yaml"
R70B = ROOT / "cookbook" / "llama" / "configs" / "70b_pretrain.yaml"  # world_size 32
NODES = ["10.0.0.1", "10.0.0.2"]


def _real_ips(per_node: int = 8) -> dict[str, list[str]]:
    return {n: [f"192.168.{100 + d}.{k + 1}" for d in range(per_node)] for k, n in enumerate(NODES)}


# --------------------------------------------------------------------------- rank table


def test_rank_table_round_trip_via_cli(tmp_path, capsys):
    out = tmp_path / "rank_table.json"
    assert main(["rank-table", "--nodes", ",".join(NODES), "--devices-per-node", "8", "-o", str(out)]) == 0
    table = json.loads(out.read_text())
    assert table["version"] == "1.0" and table["status"] == "completed" and table["server_count"] == "2"
    assert [s["server_id"] for s in table["server_list"]] == NODES
    ranks = [int(d["rank_id"]) for s in table["server_list"] for d in s["device"]]
    assert ranks == list(range(16))  # node k, device d -> rank 8k + d
    assert table["server_list"][1]["device"][3] == {"device_id": "3", "device_ip": "198.18.1.4", "rank_id": "11"}
    assert table[PLACEHOLDER_KEY] is True
    capsys.readouterr()

    assert main(["rank-table", "--check", str(out), "--world-size", "16"]) == 0
    printed = capsys.readouterr().out
    assert "2 server(s) x 8 device(s) = world size 16" in printed
    assert "placeholders" in printed  # the fallback is flagged, never silent


@pytest.mark.parametrize("fmt", ["json", "text"])
def test_device_ip_file_formats(tmp_path, fmt):
    ips = _real_ips(2)
    f = tmp_path / f"ips.{fmt}"
    if fmt == "json":
        f.write_text(json.dumps(ips))
    else:
        f.write_text("# node  device IPs\n" + "\n".join(f"{n}  {', '.join(v)}" for n, v in ips.items()) + "\n")
    assert load_device_ips(f) == ips
    table = build_rank_table(NODES, 2, load_device_ips(f))
    assert PLACEHOLDER_KEY not in table
    assert [d["device_ip"] for d in table["server_list"][1]["device"]] == ips["10.0.0.2"]
    assert check_rank_table(table, world_size=4) == []


def test_bad_generate_inputs_all_listed(tmp_path, capsys):
    ips = _real_ips(8)
    ips["10.0.0.2"] = ips["10.0.0.2"][:7] + ["192.168.1.999"]
    ips["10.0.0.9"] = ["192.168.200.1"] * 8
    del ips["10.0.0.1"]
    f = tmp_path / "ips.json"
    f.write_text(json.dumps(ips))
    rc = main(
        [
            "rank-table",
            "--nodes",
            "10.0.0.1,10.0.0.2,node3",
            "--devices-per-node",
            "8",
            "--device-ips",
            str(f),
            "-o",
            str(tmp_path / "rt.json"),
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2 and not (tmp_path / "rt.json").exists()
    for msg in [
        "--nodes: 'node3' is not an IP address",
        "--device-ips: no device IPs for node 10.0.0.1",
        "--device-ips: node 10.0.0.2 device 7: '192.168.1.999' is not an IP address",
        "--device-ips: node 10.0.0.9 is not in --nodes",
    ]:
        assert msg in err, msg


def _valid(per_node: int = 8) -> dict:
    return build_rank_table(NODES, per_node, _real_ips(per_node))


def _dev(t, s, d):
    return t["server_list"][s]["device"][d]


BAD_TABLES = {
    "duplicate rank": (
        lambda t: _dev(t, 1, 0).update(rank_id="0"),
        "server_list[1] (server_id 10.0.0.2) device[0] (device_id 0): rank_id: 0 duplicates "
        "server_list[0] (server_id 10.0.0.1) device[0]",
    ),
    "rank gap": (lambda t: _dev(t, 1, 7).update(rank_id="20"), "no gaps; missing [15], while [20] are beyond"),
    "server_count": (lambda t: t.update(server_count="3"), "server_count: says 3 but server_list has 2 servers"),
    "uneven devices": (
        lambda t: t["server_list"][1]["device"].pop(),
        "device counts differ across servers (server_list[0] (server_id 10.0.0.1): 8, "
        "server_list[1] (server_id 10.0.0.2): 7)",
    ),
    "bad server_id": (
        lambda t: t["server_list"][1].update(server_id="10.0.0.300"),
        "server_list[1] (server_id 10.0.0.300): server_id: '10.0.0.300' is not an IP address",
    ),
    "bad device_ip": (
        lambda t: _dev(t, 0, 2).update(device_ip="npu2"),
        "server_list[0] (server_id 10.0.0.1) device[2] (device_id 2): device_ip: 'npu2' is not an IP",
    ),
    "duplicate device_ip": (
        lambda t: _dev(t, 1, 0).update(device_ip=_dev(t, 0, 0)["device_ip"]),
        "device_ip: 192.168.100.1 already used by server_list[0]",
    ),
    "duplicate device_id": (
        lambda t: _dev(t, 0, 5).update(device_id="4"),
        "device[5] (device_id 4): device_id: 4 duplicates device[4] on the same server",
    ),
    "status": (lambda t: t.update(status="initializing"), "status: must be 'completed'"),
    "version": (lambda t: t.update(version="2.0"), "version: must be one of ['1.0'], got '2.0'"),
    "rank not a number": (
        lambda t: _dev(t, 0, 1).update(rank_id="one"),
        "device[1] (device_id 1): rank_id: must be a non-negative integer, got 'one'",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_TABLES))
def test_check_names_each_problem(case):
    mutate, expected = BAD_TABLES[case]
    table = _valid()
    assert check_rank_table(table) == []
    mutate(table)
    problems = check_rank_table(table)
    assert any(expected in p for p in problems), problems


def test_check_world_size_mismatch():
    assert check_rank_table(_valid(), world_size=16) == []
    assert check_rank_table(_valid(), world_size=8) == ["world size: the table has 16 devices but --world-size is 8"]


def test_check_cli_lists_all_problems_and_fails(tmp_path, capsys):
    table = _valid()
    table["server_count"] = "5"
    table["status"] = "pending"
    _dev(table, 0, 0)["device_ip"] = "300.1.1.1"
    f = tmp_path / "rt.json"
    f.write_text(json.dumps(table))
    assert main(["rank-table", "--check", str(f)]) == 1
    err = capsys.readouterr().err
    assert f"{f}: 3 problem(s)" in err
    assert "server_count: says 5" in err and "status:" in err and "'300.1.1.1' is not an IP" in err

    f.write_text('{"version": "1.0",\n "server_list": [}')
    assert main(["rank-table", "--check", str(f)]) == 1
    assert "invalid JSON at line 2" in capsys.readouterr().err


def test_rank_table_cli_usage_errors(tmp_path, capsys):
    assert main(["rank-table"]) == 2
    assert "give --nodes" in capsys.readouterr().err
    assert main(["rank-table", "--check", str(tmp_path / "x.json"), "--nodes", "10.0.0.1"]) == 2
    assert main(["rank-table", "--check", str(tmp_path / "missing.json")]) == 1
    assert "missing.json: 1 problem(s):\n  file not found" in capsys.readouterr().err


# --------------------------------------------------------------------------- slurm


def test_slurm_render(tmp_path, capsys):
    out = tmp_path / "job.sbatch"
    assert (
        main(
            [
                "slurm",
                str(R70B),
                "--nodes",
                "4",
                "--partition",
                "ascend",
                "--time",
                "12:00:00",
                "--set",
                "optim.lr=2e-4",
                "-o",
                str(out),
            ]
        )
        == 0
    )
    text = out.read_text()
    header = [ln for ln in text.splitlines()[1:] if ln.strip()][:12]
    sbatch = [ln for ln in header if ln.startswith("#SBATCH")]
    for line in [
        "#SBATCH --job-name=llama2_70b_pretrain",
        "#SBATCH --nodes=4",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --gres=npu:8",
        "#SBATCH --partition=ascend",
        "#SBATCH --time=12:00:00",
    ]:
        assert line in sbatch, line
    # every #SBATCH line comes before the first command, or sbatch ignores it
    first_cmd = next(i for i, ln in enumerate(text.splitlines()) if ln and not ln.startswith("#"))
    assert all(i < first_cmd for i, ln in enumerate(text.splitlines()) if ln.startswith("#SBATCH"))
    assert 'scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1' in text
    assert 'exec scripts/run_pretrain.sh --node_rank "$SLURM_NODEID" "$@"\'' in text  # per-task expansion
    assert '--nnodes "$SLURM_NNODES"' in text and "--nproc_per_node 8" in text
    assert f"--config {R70B}" in text and "--set optim.lr=2e-4" in text
    assert "@@" not in text
    assert subprocess.run(["bash", "-n", str(out)]).returncode == 0


@pytest.mark.parametrize("device, gres", [("cuda", "#SBATCH --gres=gpu:4"), ("cpu", None)])
def test_slurm_gres_per_device(device, gres):
    text = render(SlurmJob(str(R70B), nodes=8, devices_per_node=4, device_type=device))
    assert "#SBATCH --nodes=8" in text
    assert (gres in text) if gres else ("--gres" not in text)
    assert "#SBATCH --time" not in text and "\n\nset -euo" not in text


def test_slurm_rejects_world_size_mismatch(capsys):
    assert main(["slurm", str(R70B), "--nodes", "1"]) == 2
    err = capsys.readouterr().err
    assert "distributed.world_size=32 but --nodes 1 x --devices-per-node 8 = 8 processes; use --nodes 4" in err
    with pytest.raises(SlurmError, match="--time must be HH:MM:SS"):
        render(SlurmJob(str(R70B), nodes=4, time="12h"))


def test_slurm_bad_recipe(capsys):
    assert main(["slurm", str(R70B), "--nodes", "4", "--set", "distributed.bogus=1"]) == 2
    assert "distributed.bogus: unknown key" in capsys.readouterr().err


# --------------------------------------------------------------------------- run_pretrain.sh


def _script(*args: str, env: dict | None = None, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
        cwd=ROOT,
    )


@pytest.mark.parametrize(
    "args, message",
    [
        ((), "--config FILE is required"),
        (("--config",), "--config needs a value"),
        (("--config", str(TINY), "--epochs", "3"), "unknown argument '--epochs'"),
        (("--config", "no/such.yaml"), "--config: no such recipe file: no/such.yaml"),
        (("--config", str(TINY), "--nnodes", "2", "--master_addr", "10.0.0.1"), "--nnodes 2 needs --node_rank"),
        (("--config", str(TINY), "--nnodes", "2", "--node_rank", "0"), "--nnodes 2 needs --master_addr"),
        (
            ("--config", str(TINY), "--nnodes", "2", "--node_rank", "2", "--master_addr", "h"),
            "--node_rank must be 0..1 for --nnodes 2, got '2'",
        ),
        (("--config", str(TINY), "--nproc_per_node", "0"), "--nproc_per_node must be a positive integer"),
        (("--config", str(TINY), "--master_port", "70000"), "--master_port must be 1..65535"),
        (("--config", str(TINY), "--set", "optim.lr"), "--set expects KEY=VALUE, got 'optim.lr'"),
    ],
)
def test_run_pretrain_rejects_bad_arguments(args, message):
    r = _script(*args)
    assert r.returncode == 2
    assert f"run_pretrain.sh: {message}" in r.stderr


def test_failing_rank_ends_job_naming_rank(tmp_path):
    """Rank 1 raises; rank 0 would sleep 300 s: torchrun must stop it and the script name rank 1."""
    start = time.monotonic()
    r = _script(
        "--config",
        str(TINY),
        "--nproc_per_node",
        "2",
        timeout=120,
        env={
            "CANNTRAIN_DEVICE": "cpu",
            "RUN_PRETRAIN_TARGET": str(ROOT / "tests" / "_fail_rank.py"),
            "FAIL_RANK_SLEEP": "300",
            "TMPDIR": str(tmp_path),
        },
    )
    elapsed = time.monotonic() - start
    assert r.returncode == 1, r.stdout + r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("run_pretrain.sh: rank 1 (local rank 1 on ")
    assert "failed with exit code 1: RuntimeError: deliberate failure on rank 1" in last
    assert elapsed < 60, f"took {elapsed:.0f} s: the healthy rank was not torn down"
    log = Path(last.rsplit("full log: ", 1)[1].rstrip(")"))
    assert log.parent == tmp_path and "Root Cause" in log.read_text()


def test_npu_launch_exports_rank_table_and_hccl_env(tmp_path):
    """On an NPU (forced: CANNTRAIN_DEVICE=npu skips the probe) the script checks the rank table
    against nnodes x nproc, exports it as an absolute path plus the HCCL/ASCEND variables, and a
    value already in the environment wins over the default."""
    rt = tmp_path / "rank_table.json"
    assert main(["rank-table", "--nodes", "127.0.0.1", "--devices-per-node", "1", "-o", str(rt)]) == 0
    env = {
        "CANNTRAIN_DEVICE": "npu",
        "RUN_PRETRAIN_TARGET": str(ROOT / "tests" / "_fail_rank.py"),
        "FAIL_RANK": "-1",
        "HCCL_EXEC_TIMEOUT": "600",
        "TMPDIR": str(tmp_path),
    }
    for k in ("RANK_TABLE_FILE", "HCCL_CONNECT_TIMEOUT", "ASCEND_GLOBAL_LOG_LEVEL", "PYTORCH_NPU_ALLOC_CONF"):
        env[k] = os.environ.get(k, "")  # start from a clean slate (an empty value counts as unset)
    r = _script(
        "--config",
        str(TINY),
        "--nproc_per_node",
        "1",
        "--rank_table",
        os.path.relpath(rt, ROOT),
        "--set",
        "optim.lr=1e-3",
        env=env,
        timeout=90,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    line = next(ln for ln in r.stdout.splitlines() if "LAUNCH_ENV " in ln)
    seen = json.loads(line.split("LAUNCH_ENV ", 1)[1])
    assert seen["RANK_TABLE_FILE"] == str(rt)
    assert seen["HCCL_CONNECT_TIMEOUT"] == "1200" and seen["HCCL_EXEC_TIMEOUT"] == "600"
    assert seen["HCCL_WHITELIST_DISABLE"] == "1" and seen["ASCEND_GLOBAL_LOG_LEVEL"] == "3"
    assert seen["PYTORCH_NPU_ALLOC_CONF"] == "max_split_size_mb:512"
    assert seen["MASTER_ADDR"] == "localhost" and seen["WORLD_SIZE"] == "1"  # torchrun --standalone
    assert seen["argv"] == ["train", str(TINY), "--set", "optim.lr=1e-3"]

    r = _script("--config", str(TINY), "--nproc_per_node", "2", "--rank_table", str(rt), env=env, timeout=60)
    assert r.returncode == 2
    assert "world size: the table has 1 devices but --world-size is 2" in r.stderr
    assert f"run_pretrain.sh: rank table {rt} does not describe 1 node(s) x 2 device(s)" in r.stderr


def test_expected_failure_under_torchrun_reaches_the_launchers_summary(tmp_path):
    """A rank's expected failure is one line on its stderr, and torchrun's failure summary shows that line."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=1",  # one rank is enough to see its line reach torchrun's summary
        "-m",
        "canntrain_core.cli",
        "train",
        str(TINY),
        "--run-dir",
        str(tmp_path / "run"),
        "--set",
        "distributed.world_size=2",
        "--set",
        "distributed.data_parallel_size=2",
    ]
    r = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, "CANNTRAIN_DEVICE": "cpu", "OMP_NUM_THREADS": "1"},
    )
    assert r.returncode == 1, r.stdout + r.stderr  # torchrun's own code for a failed child
    line = "canntrain train: distributed.world_size=2 but this job has 1 process(es) (WORLD_SIZE)"
    summary = r.stderr[r.stderr.index("Root Cause") :]
    assert line in summary, r.stderr[-3000:]
    assert "exitcode  : 2" in summary, r.stderr[-3000:]  # the expected failure's code, as torchrun reports it
    assert not (tmp_path / "run").exists()
