"""Launch helpers on the command line.

``canntrain rank-table --nodes IP[,IP...] --devices-per-node 8 [--device-ips FILE] -o rank_table.json``
    write an HCCL rank table (format and device IP file: canntrain_core/runtime/rank_table.py).
``canntrain rank-table --check FILE [--world-size N]``
    validate one; prints every problem and exits 1, or prints a summary and exits 0.
``canntrain slurm RECIPE --nodes N [--partition P] [--time HH:MM:SS] [--devices-per-node K] [-o FILE]``
    render scripts/slurm/pretrain.sbatch for the recipe (stdout without -o).

Exit codes: 0 done, 1 the checked rank table is invalid, 2 bad arguments or bad recipe.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "rank-table",
        help="write or check an HCCL rank table (rank_table.json)",
        description="Write an HCCL rank table, or --check one. The format and the device IP "
        "file are described in canntrain_core/runtime/rank_table.py.",
    )
    p.add_argument("--nodes", help="comma-separated host IPs of the nodes, in rank order")
    p.add_argument("--devices-per-node", type=int, default=8, help="NPUs per node (default 8)")
    p.add_argument(
        "--device-ips",
        metavar="FILE",
        help="JSON or text file: node IP -> device IPs; without it device IPs are placeholders",
    )
    p.add_argument("-o", "--output", default="rank_table.json", help="where to write (default rank_table.json)")
    p.add_argument("--check", metavar="FILE", help="validate this rank table instead of writing one")
    p.add_argument("--world-size", type=int, default=None, help="with --check: the expected number of devices")
    p.set_defaults(func=run_rank_table)

    s = sub.add_parser("slurm", help="render the Slurm batch script for a recipe")
    s.add_argument("recipe", help="recipe YAML file")
    s.add_argument("--nodes", type=int, required=True, help="number of nodes")
    s.add_argument("--devices-per-node", type=int, default=8, help="devices (= processes) per node (default 8)")
    s.add_argument(
        "--device-type",
        default="npu",
        choices=["npu", "cuda", "cpu"],
        help="sets the GRES request: npu:K, gpu:K, or none on CPU (default npu)",
    )
    s.add_argument("--partition", default=None)
    s.add_argument("--time", default=None, metavar="HH:MM:SS", help="wall-clock limit (default: the partition's)")
    s.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="recipe override, checked now and passed on to the job (repeatable)",
    )
    s.add_argument("-o", "--output", default=None, help="write the script here (default: stdout)")
    s.set_defaults(func=run_slurm)


def run_rank_table(args: argparse.Namespace) -> int:
    # deferred: start-up time (canntrain --help does not load runtime.rank_table)
    from canntrain_core.runtime.rank_table import (
        RankTableError,
        build_rank_table,
        check_rank_table,
        load_device_ips,
        load_rank_table,
        summarize,
        write_rank_table,
    )

    try:
        if args.check:
            if args.nodes or args.device_ips:
                return _usage("--check validates an existing file; do not combine it with --nodes/--device-ips")
            table = load_rank_table(args.check)
            problems = check_rank_table(table, args.world_size)
            if problems:
                print(RankTableError(problems, source=args.check), file=sys.stderr)
                return 1
            print(f"{args.check}: OK")
            print(summarize(table))
            return 0
        if not args.nodes:
            return _usage("give --nodes IP[,IP...] to write a rank table, or --check FILE to validate one")
        nodes = [n.strip() for n in args.nodes.split(",") if n.strip()]
        device_ips = load_device_ips(args.device_ips) if args.device_ips else None
        table = build_rank_table(nodes, args.devices_per_node, device_ips)
    except RankTableError as e:
        print(f"canntrain rank-table: {e}", file=sys.stderr)
        return 1 if args.check else 2
    out = write_rank_table(table, args.output)
    print(f"wrote {out}")
    print(summarize(table))
    return 0


def run_slurm(args: argparse.Namespace) -> int:
    # deferred: start-up time (canntrain --help does not load jobs.slurm)
    from canntrain_core.jobs.slurm import SlurmError, SlurmJob, render

    job = SlurmJob(
        recipe=args.recipe,
        nodes=args.nodes,
        devices_per_node=args.devices_per_node,
        device_type=args.device_type,
        partition=args.partition,
        time=args.time,
        overrides=args.overrides,
    )
    try:
        text = render(job)  # a RecipeError goes up to canntrain's main (exit 2, message names the key)
    except SlurmError as e:
        print(e, file=sys.stderr)
        return 2
    if args.output:
        Path(args.output).write_text(text)
        print(f"wrote {args.output}: submit with `sbatch {args.output}`")
    else:
        print(text, end="")
    return 0


def _usage(message: str) -> int:
    print(f"canntrain rank-table: {message}", file=sys.stderr)
    return 2
