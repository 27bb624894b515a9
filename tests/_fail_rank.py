"""Torchrun target for tests/jobs/test_launch.py (stands in for `canntrain train`; imports no torch).

Rank $FAIL_RANK (default 1) raises; the other ranks sleep $FAIL_RANK_SLEEP seconds, standing in
for ranks blocked in a collective, so torchrun has to tear them down. With FAIL_RANK=-1 no rank
fails: each prints the launch environment (RANK_TABLE_FILE, HCCL_*, ASCEND_*, ...) as one JSON
line and exits 0.
"""

import json
import os
import sys
import time

rank = int(os.environ["RANK"])
fail_rank = int(os.environ.get("FAIL_RANK", "1"))
if fail_rank < 0:
    keys = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "RANK_TABLE_FILE", "PYTORCH_NPU_ALLOC_CONF")
    env = {k: v for k, v in os.environ.items() if k in keys or k.startswith(("HCCL_", "ASCEND_"))}
    print("LAUNCH_ENV " + json.dumps({**env, "argv": sys.argv[1:]}))
    sys.exit(0)
if rank == fail_rank:
    raise RuntimeError(f"deliberate failure on rank {rank}")
time.sleep(int(os.environ.get("FAIL_RANK_SLEEP", "120")))
