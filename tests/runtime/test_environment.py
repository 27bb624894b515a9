"""The ranks' environments compared (runtime/environment.py); the two-rank launches are in
tests/train/test_observability.py (another CANN on rank 1) and the bad input target_device_not_here.yaml."""

from canntrain_core.runtime.environment import disagreement, rank_environment


def _env(host, device="npu", cann="8.1.RC1", npu="2.13.0"):
    return {"host": host, "device": device, "torch": "2.13.0", "torch_npu": npu, "CANN": cann}


def test_agreeing_ranks_say_nothing_and_this_process_describes_itself():
    assert disagreement([_env("a"), _env("a"), _env("b")]) is None
    here = rank_environment("cpu")
    assert (
        here["device"] == "cpu"
        and here["torch_npu"] == "not importable"
        and set(here)
        == {
            "host",
            "device",
            "torch",
            "torch_npu",
            "CANN",
        }
    )


def test_a_node_without_torch_npu_is_named_by_its_ranks_and_host():
    broken = "import failed: OSError: libhccl.so: cannot open shared object file"
    found = [_env("node-a")] * 8 + [_env("node-b", device="cpu", npu=broken)] * 8
    assert disagreement(found) == (
        "the ranks of this job disagree on device, torch_npu: ranks 0-7 (node-a): device npu, torch_npu 2.13.0; "
        f"ranks 8-15 (node-b): device cpu, torch_npu {broken}. Every rank must see the same device and versions: "
        "run `canntrain doctor` on each node"
    )
    odd = disagreement([_env("a"), _env("a", cann="8.0.RC1"), _env("a"), _env("b")])
    assert odd.startswith("the ranks of this job disagree on CANN: ranks 0,2-3 (a, b): CANN 8.1.RC1; rank 1 (a):")
