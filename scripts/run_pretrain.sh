#!/usr/bin/env bash
# Run a recipe without Jupyter, under torchrun, on one node or many.
#   scripts/run_pretrain.sh --config FILE
#       [--nnodes N --node_rank R --master_addr ADDR --master_port PORT]
#       [--nproc_per_node K] [--rank_table FILE]
#       [--resume_from PATH|auto] [--run_dir DIR] [--set KEY=VALUE]...
# One node: the master address is 127.0.0.1 on a free port and K defaults to the local device
# count (NPUs, else GPUs, else 1 process on CPU). Several nodes: run it on every node with the
# same --nnodes/--master_addr/--master_port and that node's --node_rank (0 on the master).
# On NPUs it exports RANK_TABLE_FILE (--rank_table, or already in the environment, checked
# first) and the HCCL/ASCEND variables below. If a rank fails, torchrun stops the others, and
# this script exits non-zero with a last line naming the failed rank and its error.
# Environment: PYTHON (interpreter), CANNTRAIN_DEVICE (npu|cuda|cpu, skips the device probe
# when --nproc_per_node is given), RUN_PRETRAIN_TARGET (tests only: a Python file torchrun runs
# instead of `canntrain train`).
set -euo pipefail

die() { echo "run_pretrain.sh: $*" >&2; exit 2; }
need_value() { [[ $# -ge 2 && -n "$2" && "$2" != --* ]] || die "$1 needs a value (see --help)"; }
is_uint() { [[ "$1" =~ ^[0-9]+$ ]]; }

config="" resume="" run_dir="" rank_table="${RANK_TABLE_FILE:-}" sets=()
nnodes=1 node_rank="" master_addr="" master_port="" nproc=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --config|--resume_from|--run_dir|--set|--nnodes|--node_rank|--master_addr|--master_port|--nproc_per_node|--rank_table)
      need_value "$@" ;;&
    --config) config="$2" ;;
    --resume_from) resume="$2" ;;
    --run_dir) run_dir="$2" ;;
    --set) [[ "$2" == *=* ]] || die "--set expects KEY=VALUE, got '$2'"; sets+=(--set "$2") ;;
    --nnodes) nnodes="$2" ;;
    --node_rank) node_rank="$2" ;;
    --master_addr) master_addr="$2" ;;
    --master_port) master_port="$2" ;;
    --nproc_per_node) nproc="$2" ;;
    --rank_table) rank_table="$2" ;;
    -h|--help) sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
  shift 2
done

# ---- validate ------------------------------------------------------------------------------
[[ -n "$config" ]] || die "--config FILE is required"
[[ -f "$config" ]] || die "--config: no such recipe file: $config"
is_uint "$nnodes" && (( nnodes >= 1 )) || die "--nnodes must be a positive integer, got '$nnodes'"
if (( nnodes > 1 )); then
  [[ -n "$node_rank" ]] || die "--nnodes $nnodes needs --node_rank (0..$((nnodes - 1)), 0 on the master node)"
  [[ -n "$master_addr" ]] || die "--nnodes $nnodes needs --master_addr (the address of node 0, reachable from every node)"
fi
node_rank="${node_rank:-0}"
is_uint "$node_rank" && (( node_rank < nnodes )) || die "--node_rank must be 0..$((nnodes - 1)) for --nnodes $nnodes, got '$node_rank'"
if [[ -n "$master_port" ]]; then
  is_uint "$master_port" && (( master_port >= 1 && master_port <= 65535 )) || die "--master_port must be 1..65535, got '$master_port'"
fi
if [[ -n "$nproc" ]]; then
  is_uint "$nproc" && (( nproc >= 1 )) || die "--nproc_per_node must be a positive integer, got '$nproc'"
fi

here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-$here/.venv/bin/python}"
[[ -x "$python" ]] || python="$(command -v python3)" || die "no Python found (set PYTHON)"

# ---- device type and count, from canntrain_core.runtime (the one place that knows) ----------
device="${CANNTRAIN_DEVICE:-}" count=""
if [[ -z "$device" || -z "$nproc" ]]; then
  probe="$("$python" -c 'from canntrain_core.runtime.accelerator import get_accelerator as g; a = g(); print(a.type, a.device_count())')" \
    || die "could not probe the accelerator with $python (is canntrain installed in it?)"
  read -r device count <<< "$probe"
fi
nproc="${nproc:-$count}"
(( nproc >= 1 )) || die "no device found on this node and --nproc_per_node not given"

# ---- rendezvous ----------------------------------------------------------------------------
if (( nnodes == 1 )) && [[ -z "$master_port" ]]; then
  # torchrun --standalone: its store binds a free local port itself, so two single-node runs on one
  # machine never collide (probing a free port and handing it over raced with other launches under load).
  rendezvous=(--standalone)
  where="a free local port"
else
  master_addr="${master_addr:-127.0.0.1}"
  master_port="${master_port:-29500}"  # torchrun's default; every node must use the same one
  rendezvous=(--nnodes "$nnodes" --node_rank "${node_rank:-0}" --master_addr "$master_addr" --master_port "$master_port")
  where="$master_addr:$master_port"
fi

# ---- Ascend NPU environment ----------------------------------------------------------------
# Values already in the environment win (${VAR:=default}). Names checked against the CANN
# environment-variable reference; of the seed article's template, ASCEND_NPUS_PER_HOST and
# HCCL_COMM_WORLD_ROOT are not CANN variables (nothing reads them) and are not exported, and its
# PYTORCH_CUDA_ALLOC_conf is the CUDA allocator's name: torch_npu reads PYTORCH_NPU_ALLOC_CONF.
if [[ "$device" == "npu" ]]; then
  if [[ -n "$rank_table" ]]; then
    [[ -f "$rank_table" ]] || die "--rank_table / RANK_TABLE_FILE: no such file: $rank_table"
    # (canntrain rank-table --check, run by path: it needs no torch import)
    "$python" "$here/canntrain_core/runtime/rank_table.py" "$rank_table" $((nnodes * nproc)) >&2 \
      || die "rank table $rank_table does not describe $nnodes node(s) x $nproc device(s) (problems above)"
    # The HCCL rank table (canntrain rank-table): which NPU (device_id, device_ip) holds which rank.
    export RANK_TABLE_FILE="$(cd "$(dirname "$rank_table")" && pwd)/$(basename "$rank_table")"
  fi
  # Seconds HCCL waits for every device to set up its links at init (range 120-7200, default 120);
  # nodes of a multi-node job start seconds to minutes apart.
  export HCCL_CONNECT_TIMEOUT="${HCCL_CONNECT_TIMEOUT:=1200}"
  # Seconds a device waits for its peers inside a collective before HCCL reports a failure
  # (default 1836): bounds the hang when a rank dies outside torchrun's view.
  export HCCL_EXEC_TIMEOUT="${HCCL_EXEC_TIMEOUT:=1800}"
  # 1 = no HCCL communication whitelist check (CANN's default; a whitelist needs HCCL_WHITELIST_FILE).
  export HCCL_WHITELIST_DISABLE="${HCCL_WHITELIST_DISABLE:=1}"
  # CANN log level: 0 debug, 1 info, 2 warning, 3 error (the cann-recipes-train articles' choice: errors only).
  export ASCEND_GLOBAL_LOG_LEVEL="${ASCEND_GLOBAL_LOG_LEVEL:=3}"
  # torch_npu caching allocator: do not split blocks above 512 MB, less fragmentation (the cann-recipes-train articles).
  export PYTORCH_NPU_ALLOC_CONF="${PYTORCH_NPU_ALLOC_CONF:=max_split_size_mb:512}"
  # HCCL_IF_IP / HCCL_SOCKET_IFNAME (host NIC for HCCL's socket setup) are left to the cluster.
elif [[ "${rank_table}" != "" && "${RANK_TABLE_FILE:-}" != "$rank_table" ]]; then
  echo "run_pretrain.sh: --rank_table ignored: the accelerator is $device, not an NPU" >&2
fi

# ---- launch ----------------------------------------------------------------------------------
args=(train "$config" "${sets[@]}")
[[ -n "$resume" ]] && args+=(--resume-from "$resume")
[[ -n "$run_dir" ]] && args+=(--run-dir "$run_dir")
target=(-m canntrain_core.cli)
[[ -n "${RUN_PRETRAIN_TARGET:-}" ]] && target=("$RUN_PRETRAIN_TARGET")

export PYTHONUNBUFFERED=1
log="$(mktemp "${TMPDIR:-/tmp}/run_pretrain.XXXXXX.log")"
echo "run_pretrain.sh: $device, node ${node_rank:-0} of $nnodes, $nproc process(es) per node, master $where"
# --tee 3 prefixes every worker line with [default<local_rank>]: so a failure can be attributed.
set +e
"$python" -m torch.distributed.run "${rendezvous[@]}" --nproc_per_node "$nproc" --tee 3 \
  "${target[@]}" "${args[@]}" 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
set -e
if (( rc == 0 )); then rm -f "$log"; exit 0; fi

# torchrun's failure summary names the first failed rank under "Root Cause"; its last line of
# output (the exception) is the error.
read -r rank lrank host code < <(awk '
  /Root Cause/ {f = 1}
  f && $1 == "host" {host = $3}
  f && $1 == "rank" {rank = $3; lr = $5; sub(/\)/, "", lr)}
  f && $1 == "exitcode" {print rank, lr, host, $3; exit}' "$log") || true
if [[ -n "${rank:-}" ]]; then
  error="$(grep -E "^\[[A-Za-z_]*${lrank}\]:" "$log" | sed -E 's/^\[[^]]*\]://' | grep -v '^[[:space:]]*$' | tail -n 1)"
  echo "run_pretrain.sh: rank $rank (local rank $lrank on $host) failed with exit code $code: ${error:-no error output}; all ranks stopped (full log: $log)" >&2
else
  echo "run_pretrain.sh: torchrun exited with code $rc before any rank reported a failure; see the output above (log: $log)" >&2
fi
exit "$rc"
