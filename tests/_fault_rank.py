"""Torchrun target for the fault tests (tests/train/test_observability.py): the tiny recipe under FSDP2 on 2 gloo
ranks with a 5 s collective timeout, rank 1 meeting a real fault ($FAULT):

- ``hang``: stuck for 60 s waiting for step 3's batch (a hung data loader, a slow file system);
- ``kill``: SIGKILLed while waiting for step 3's batch (a node lost, the OOM killer);
- ``cann``: it sees another CANN toolkit than rank 0 (``ASCEND_TOOLKIT_HOME`` = $OTHER_CANN, as a node
  with another install would).

    FAULT=hang torchrun --nproc_per_node 2 tests/_fault_rank.py RUN_DIR DATA_CACHE

Ends as ``canntrain train`` does: an expected failure is one line on stderr and its exit code.
"""

import os
import signal
import sys
import time

from canntrain_core.cli import report_failure
from canntrain_core.errors import CanntrainError
from canntrain_core.recipe import load_recipe
from canntrain_core.train.trainer import Trainer
from conftest import FAST, TINY

FAULT = os.environ.get("FAULT", "hang")


class FaultAtStep3(Trainer):
    def batches(self):
        for step, batch in enumerate(super().batches(), start=1):
            if step == 3 and self.rank == 1:
                if FAULT == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                time.sleep(60)
            yield batch


def main(run_dir: str, data_cache: str) -> int:
    if FAULT == "cann" and os.environ["RANK"] == "1":
        os.environ["ASCEND_TOOLKIT_HOME"] = os.environ["OTHER_CANN"]
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
        FaultAtStep3(recipe, run_dir=run_dir, progress=False).fit()
    except CanntrainError as e:
        return report_failure("train", e)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
