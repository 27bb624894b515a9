#!/usr/bin/env python
"""Draw the loss curves of one or more run directories into a PNG.

    python scripts/plot_loss.py RUN_DIR [RUN_DIR ...] [-o loss.png]

Default output: RUN_DIR/plots/loss.png for one run, ./loss.png for several.
"""

import argparse
import sys
from pathlib import Path

from canntrain_core.viz.plots import plot_loss


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("run_dirs", nargs="+", type=Path)
    p.add_argument("-o", "--out", type=Path, default=None)
    args = p.parse_args()
    for d in args.run_dirs:
        if not (d / "metrics.jsonl").is_file():
            print(f"plot_loss: {d} has no metrics.jsonl", file=sys.stderr)
            return 2
    out = args.out or (args.run_dirs[0] / "plots" / "loss.png" if len(args.run_dirs) == 1 else Path("loss.png"))
    print(plot_loss(args.run_dirs, out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
