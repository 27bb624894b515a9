#!/usr/bin/env bash
# Run a recipe without Jupyter, under torchrun.
#   scripts/run_pretrain.sh --config FILE [--resume_from PATH|auto] [--run_dir DIR] [--set KEY=VALUE]...
# One process for now (multi-process and multi-node launch come with the distributed recipes).
set -euo pipefail

config="" resume="" run_dir="" sets=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --config) config="$2"; shift 2 ;;
    --resume_from) resume="$2"; shift 2 ;;
    --run_dir) run_dir="$2"; shift 2 ;;
    --set) sets+=(--set "$2"); shift 2 ;;
    -h|--help) sed -n '2,4p' "$0"; exit 0 ;;
    *) echo "run_pretrain.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
[[ -n "$config" ]] || { echo "run_pretrain.sh: --config FILE is required" >&2; exit 2; }
[[ -f "$config" ]] || { echo "run_pretrain.sh: no such recipe: $config" >&2; exit 2; }

here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-$here/.venv/bin/python}"
[[ -x "$python" ]] || python="$(command -v python3)"

args=(train "$config" "${sets[@]}")
[[ -n "$resume" ]] && args+=(--resume-from "$resume")
[[ -n "$run_dir" ]] && args+=(--run-dir "$run_dir")

exec "$python" -m torch.distributed.run --standalone --nnodes 1 --nproc_per_node 1 \
  -m canntrain_core.cli "${args[@]}"
