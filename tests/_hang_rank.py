"""Torchrun target for tests/train/test_observability.py: the tiny recipe under FSDP2 on 2 gloo ranks, with rank 1
stuck for 60 s waiting for step 3's batch (a hung data loader, a slow file system) and a 5 s collective timeout.

    torchrun --nproc_per_node 2 tests/_hang_rank.py RUN_DIR DATA_CACHE

Ends as ``canntrain train`` does: an expected failure is one line on stderr and its exit code.
"""

import sys
import time

from canntrain_core.cli import report_failure
from canntrain_core.errors import CanntrainError
from canntrain_core.recipe import load_recipe
from canntrain_core.train.trainer import Trainer
from conftest import FAST, TINY


class StuckAtStep3(Trainer):
    def batches(self):
        for step, batch in enumerate(super().batches(), start=1):
            if step == 3 and self.rank == 1:
                time.sleep(60)
            yield batch


def main(run_dir: str, data_cache: str) -> int:
    recipe = load_recipe(
        TINY,
        {
            **FAST,
            "data.cache_dir": data_cache,
            "distributed.world_size": 2,
            "distributed.data_parallel_size": 2,
            "distributed.zero_optimization": 3,
            "distributed.timeout_seconds": 5,
            "optim.max_steps": 6,
            "logging.ckpt_interval": 2,
            "logging.eval_interval": 100,
        },
    )
    try:
        StuckAtStep3(recipe, run_dir=run_dir, progress=False).fit()
    except CanntrainError as e:
        return report_failure("train", e)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
