"""What tests/jobs/test_local_ranks.py runs on forked local ranks (module-level: a rank receives its function by
name)."""

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist


def sum_ranks(out: str) -> None:
    """Join the job by torchrun's environment (env://), all-reduce the ranks' numbers, save what this rank saw."""
    dist.init_process_group("gloo")
    total = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(total)
    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "OMP_NUM_THREADS", "CALLER_SET")
    seen = {k: os.environ.get(k) for k in keys}
    seen.update(total=total.item(), threads=torch.get_num_threads(), cwd=os.getcwd())
    print(f"rank {dist.get_rank()} says hello")
    Path(out, f"rank{dist.get_rank()}.json").write_text(json.dumps(seen))
    dist.barrier()
    dist.destroy_process_group()


def fail_on(rank: int, sleep_s: float) -> None:
    """``rank`` fails at once (-1: none does); the others stand in for ranks blocked in a collective, for
    ``sleep_s``."""
    if os.environ["RANK"] == str(rank):
        print(f"rank {rank} is about to fail", file=sys.stderr)
        raise ValueError(f"deliberate failure on rank {rank}")
    time.sleep(sleep_s)
