"""Weights from the trainer's rank 0 straight into a vLLM engine's workers over a process group of their own, with
no file between: gloo on a CPU, NCCL on CUDA, HCCL on an NPU (``rlhf.rollout.weight_sync: broadcast``).

Both sides import this file: canntrain as ``canntrain_core.engines.weight_sync``, and vLLM's workers as the module
``weight_sync`` (``vllm_server.py`` puts this folder on their path and names :class:`WeightReceiver` as vLLM's
``worker_extension_cls``, which vLLM mixes into its worker class), so it needs torch and the standard library only.
The group is made without torch.distributed's default group, from a TCPStore the trainer's rank 0 hosts (as vLLM's
and vllm-ascend's stateless groups): the trainer keeps its default group for its own ranks, the engine keeps its own.
Group rank 0 is the trainer's rank 0; rank 1 + i is the engine's worker i (one per tensor-parallel rank), which
receives every tensor whole and vLLM's in-place reload (``reload_weights`` with an iterator) takes its slice as
they arrive, layer by layer: a worker holds at most a layer's tensors beyond its shard.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist


def open_group(host: str, port: int, rank: int, size: int, device_type: str, timeout_s: float):
    """This process's member of the trainer-engine group: (the backend's process group, its store). Rank 0 hosts
    the store; every member calls this at the same time (it returns once all ``size`` have joined)."""
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, port, size, is_master=rank == 0, timeout=timeout, wait_for_workers=False)
    if device_type == "cpu":
        return dist.ProcessGroupGloo(store, rank, size, timeout), store
    if device_type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, options), store
    if device_type == "npu":
        # deferred: optional (torch_npu, which exists only where CANN does)
        from torch_npu._C._distributed_c10d import ProcessGroupHCCL

        options = ProcessGroupHCCL.Options()
        options._timeout = timeout
        return ProcessGroupHCCL(store, rank, size, options), store
    raise ValueError(f"no weight broadcast on device type {device_type!r} (cpu, cuda, npu)")


def start_broadcast(group, tensor: torch.Tensor):
    """One tensor from group rank 0 to every member (in place on the receivers): the pending work."""
    options = dist.BroadcastOptions()
    options.rootRank = 0
    return group.broadcast([tensor], options)


class WeightReceiver:
    """Mixed into each vLLM worker; the server reaches these methods through ``LLM.collective_rpc``."""

    def canntrain_join(self, host: str, port: int, size: int, timeout_s: float) -> None:
        self._canntrain_group = open_group(host, port, 1 + self.rank, size, self.device.type, timeout_s)

    def canntrain_receive(self, params: list, dtype: str) -> int:
        """Receive ``params`` ((Hugging Face name, shape) pairs, in the trainer's order) into the model through
        vLLM's in-place reload, which takes them as they arrive (and redoes its own post-load processing, such as
        a CPU's repacked weights); the bytes received."""
        group, _ = self._canntrain_group
        received = [0]

        def arriving():
            for name, shape in params:
                tensor = torch.empty(shape, dtype=getattr(torch, dtype), device=self.device)
                start_broadcast(group, tensor).wait()
                received[0] += tensor.numel() * tensor.element_size()
                yield name, tensor

        self.reload_weights(weights_iterator=arriving())
        return received[0]
