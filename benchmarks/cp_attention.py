#!/usr/bin/env python
"""Context-parallel attention on this machine: ring vs all-gather (canntrain_core/parallel/context.py) on cp gloo
processes, forward and backward time, bytes each rank sends and bytes kept for backward. ``ring`` runs its
blocks on the kernel registry's eager attention_block (tiled matmuls), ``ring_cpu`` on its cpu backend (torch's
flash attention for CPU).

    python benchmarks/cp_attention.py [--cp 2 4] [--seq 1024 4096] [--reps 5] [--probe-torch]

Bytes are counted, not estimated: the script wraps the collectives context.py calls and adds up what each rank
sends (a point-to-point send's tensor; for an all-gather / reduce-scatter the (cp - 1) blocks a rank passes on
in a ring algorithm: what it receives, resp. its input less its output). "kept" is what autograd saves for
backward (saved_tensors_hooks, each storage once). One process's causal SDPA over the whole sequence is the
reference time. ``--probe-torch``: whether torch's own ``context_parallel`` runs here (2 gloo processes, SDPA
is_causal, fp32 and fp64, forward and backward), its error or its difference from full attention.
Not a test: times vary by machine and by load.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

BATCH, HEADS, KV_HEADS, HEAD_DIM = 1, 8, 2, 64
MARK = "@@ "  # lines rank 0 prints for the launcher


# ------------------------------------------------------------------------------------------ counting bytes
class Traffic:
    """Bytes sent by this rank through the collectives context.py calls, by wrapping them."""

    def __init__(self) -> None:
        self.sent = 0
        self._wrap("batch_isend_irecv", lambda ops: sum(_nbytes(o.tensor) for o in ops if o.op is dist.isend))
        self._wrap("all_gather_single", lambda out, inp, **_: _nbytes(out) - _nbytes(inp))
        self._wrap("reduce_scatter_single", lambda out, inp, **_: _nbytes(inp) - _nbytes(out))

    def _wrap(self, name: str, count) -> None:
        original = getattr(dist, name)

        def counted(*args, **kwargs):
            self.sent += count(*args, **kwargs)
            return original(*args, **kwargs)

        setattr(dist, name, counted)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@contextlib.contextmanager
def kept_for_backward(total: list[int]):
    """Adds to total[0] the bytes autograd saves for backward inside the block (each storage once)."""
    seen = set()

    def pack(t):
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total[0] += t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield


# ------------------------------------------------------------------------------------------------ workers
def bench_worker(seqs: list[int], reps: int) -> None:
    from canntrain_core.parallel.context import allgather_attention, ring_attention, split
    from canntrain_kernels import get

    ring_cpu = functools.partial(ring_attention, block=get("attention_block", "cpu"))

    traffic = Traffic()
    cp, rank = dist.get_world_size(), dist.get_rank()
    for seq in seqs:
        g = torch.Generator().manual_seed(seq)
        q = torch.randn(BATCH, HEADS, seq, HEAD_DIM, generator=g)
        k, v = (torch.randn(BATCH, KV_HEADS, seq, HEAD_DIM, generator=g) for _ in range(2))
        local = [split(t, cp, rank, dim=2) for t in (q, k, v)]
        for name, attention in (("ring", ring_attention), ("ring_cpu", ring_cpu), ("allgather", allgather_attention)):
            fwd, total, sent, kept = [], [], [0, 0], [0]
            for rep in range(reps + 1):  # the first is a warm-up
                inputs = [t.clone().requires_grad_() for t in local]
                dist.barrier()
                before, t0 = traffic.sent, time.perf_counter()
                with kept_for_backward(kept) if rep == 0 else contextlib.nullcontext():
                    out = attention(*inputs)
                t1, middle = time.perf_counter(), traffic.sent
                out.backward(torch.ones_like(out))
                t2 = time.perf_counter()
                if rep:
                    fwd.append(t1 - t0)
                    total.append(t2 - t0)
                sent = [middle - before, traffic.sent - middle]
            worst = torch.tensor([sorted(fwd)[len(fwd) // 2], sorted(total)[len(total) // 2]], dtype=torch.float64)
            dist.all_reduce(worst, op=dist.ReduceOp.MAX)  # the slowest rank's median
            if rank == 0:
                print(
                    f"{MARK}{cp:>3} {seq:>6} {name:>10} {1e3 * worst[0]:>9.1f} {1e3 * worst[1]:>11.1f}"
                    f" {sent[0] / 2**20:>10.2f} {sent[1] / 2**20:>10.2f} {kept[0] / 2**20:>9.2f}",
                    flush=True,
                )


def probe_worker() -> None:
    """torch.distributed.tensor.experimental.context_parallel with SDPA is_causal, fp32 and fp64."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.nn.attention import SDPBackend, sdpa_kernel

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("cp",))
    cases = [(d, b, m) for d in (torch.float32, torch.float64) for b in (False, True) for m in (None, "math")]
    for dtype, backward, backend in cases:
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, 2, 16, 8, generator=g, dtype=dtype) for _ in range(3))
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        buffers = [q.clone(), k.clone(), v.clone(), ref.clone()]  # sharded in place (load-balanced) inside
        pick = sdpa_kernel([SDPBackend.MATH]) if backend else contextlib.nullcontext()
        try:
            with context_parallel(mesh, buffers=buffers, buffer_seq_dims=[2, 2, 2, 2]), torch.enable_grad(), pick:
                lq, lk, lv = (t.detach().requires_grad_(backward) for t in buffers[:3])
                out = F.scaled_dot_product_attention(lq, lk, lv, is_causal=True)
                if backward:
                    out.sum().backward()
                result = f"runs; max |out - full SDPA's shard| = {(out.detach() - buffers[3]).abs().max():.2e}"
        except Exception as e:  # the finding is the error itself
            result = f"{type(e).__name__}: {str(e).splitlines()[0]}"
        if dist.get_rank() == 0:
            how = f"{dtype} {'forward+backward' if backward else 'forward'}, SDPA backend {backend or 'default'}"
            print(f"{MARK}{how}: {result}", flush=True)


def worker(args: argparse.Namespace) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    if args.probe_torch:
        probe_worker()
    else:
        bench_worker(args.seq, args.reps)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # as tests/_ep_ranks.py: skip C++ static destructors that rarely abort after gloo's teardown


# ----------------------------------------------------------------------------------------------- launcher
def launch(nproc: int, extra: list[str]) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    cmd += [str(Path(__file__).resolve()), "--worker", *extra]
    run = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines = [line[len(MARK) :] for line in run.stdout.splitlines() if line.startswith(MARK)]
    print("\n".join(lines), flush=True)
    if run.returncode:
        sys.exit(run.stderr[-3000:])


def single_process(seqs: list[int], reps: int) -> None:
    torch.set_num_threads(1)
    for seq in seqs:
        q = torch.randn(BATCH, HEADS, seq, HEAD_DIM)
        k, v = (torch.randn(BATCH, KV_HEADS, seq, HEAD_DIM) for _ in range(2))
        fwd, total = [], []
        for _ in range(reps + 1):
            inputs = [t.clone().requires_grad_() for t in (q, k, v)]
            t0 = time.perf_counter()
            out = F.scaled_dot_product_attention(*inputs, is_causal=True, enable_gqa=True)
            t1 = time.perf_counter()
            out.backward(torch.ones_like(out))
            fwd.append(t1 - t0)
            total.append(time.perf_counter() - t0)
        fwd, total = sorted(fwd[1:]), sorted(total[1:])
        print(f"  1 {seq:>6} {'sdpa':>10} {1e3 * fwd[reps // 2]:>9.1f} {1e3 * total[reps // 2]:>11.1f}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cp", type=int, nargs="+", default=[2, 4])
    p.add_argument("--seq", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--probe-torch", action="store_true")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        return worker(a)
    print(f"torch {torch.__version__}, gloo, one thread per process")
    if a.probe_torch:
        return launch(2, ["--probe-torch"])
    print(f"batch {BATCH}, {HEADS} query heads, {KV_HEADS} kv heads, head_dim {HEAD_DIM}, fp32, causal; medians")
    print(" cp    seq  attention    fwd ms  fwd+bwd ms  fwd MiB/r  bwd MiB/r  kept MiB")
    single_process(a.seq, a.reps)
    for cp in a.cp:
        launch(cp, ["--seq", *map(str, a.seq), "--reps", str(a.reps)])


if __name__ == "__main__":
    main()
