"""One rank of a notebook job: `canntrain run NOTEBOOK --nproc_per_node K` starts this under torchrun.

    python -m canntrain_core.jobs.rank_notebook NOTEBOOK RUN_DIR PARAMS_JSON

Each rank executes the notebook with papermill; the kernel inherits RANK, WORLD_SIZE, MASTER_ADDR
and MASTER_PORT, so the Trainer inside joins the same process group. Rank 0's executed notebook
is the report (RUN_DIR/NOTEBOOK); the others land in RUN_DIR/ranks/rankR.ipynb.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from canntrain_core.jobs.papermill_runner import NotebookFailed, execute


def main(notebook: str, run_dir: str, params_json: str) -> int:
    rank = int(os.environ.get("RANK", "0"))
    out = Path(run_dir) / Path(notebook).name if rank == 0 else Path(run_dir) / "ranks" / f"rank{rank}.ipynb"
    try:
        execute(notebook, out, {"run_dir": run_dir, **json.loads(params_json)}, progress=False)
    except NotebookFailed as e:
        print(f"rank {rank}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
