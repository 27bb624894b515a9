"""Process groups and the named DeviceMesh built from a recipe's `distributed` section.

Mesh dimensions, outermost first, as torchtitan names them: pp, dp_replicate, dp_shard, cp, tp.
Data parallelism is `dp_replicate` (plain DDP, zero_optimization 0) or `dp_shard` (FSDP2,
zero_optimization 1-3). Only dimensions larger than one are built. Expert parallelism borrows its ranks
from `dp_shard`, as torchtitan's does: the mesh holds `dp_shard_mod_ep` x `ep` (kept even at size one),
flattened back into `dp_shard` for everything that is not an expert.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from canntrain_core.recipe import DistributedConfig, Recipe, RecipeError
from canntrain_core.sizing.layout import Layout
from canntrain_core.runtime.accelerator import Accelerator
from canntrain_core.runtime.watchdog import enable_flight_recorder


@dataclass(frozen=True)
class ParallelDims:
    pp: int
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    ep: int = 1  # ranks of dp_shard that split the experts between them

    @classmethod
    def from_layout(cls, layout: Layout) -> "ParallelDims":
        """The mesh of ``layout`` (``Recipe.layout``: the one reading of a recipe's sizes): data parallel
        is FSDP2's ``dp_shard`` or DDP's ``dp_replicate``, as ``Layout.dp_shard`` says."""
        return cls(
            pp=layout.pp,
            dp_replicate=layout.dp // layout.dp_shard,
            dp_shard=layout.dp_shard,
            cp=layout.cp,
            tp=layout.tp,
            ep=layout.ep,
        )

    @classmethod
    def from_recipe(cls, recipe: Recipe) -> "ParallelDims":
        return cls.from_layout(recipe.layout)

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def non_data_parallel(self) -> int:
        """Devices that share one data-parallel sample: throughput per device divides by this."""
        return self.pp * self.cp * self.tp

    def named_sizes(self) -> list[tuple[str, int]]:
        dims = [
            ("pp", self.pp),
            ("dp_replicate", self.dp_replicate),
            ("dp_shard", self.dp_shard),
            ("cp", self.cp),
            ("tp", self.tp),
        ]
        return [(n, s) for n, s in dims if s > 1]

    def mesh_sizes(self) -> list[tuple[str, int]]:
        """The built mesh's dimensions: ``named_sizes`` with dp_shard split as dp_shard_mod_ep x ep under EP."""
        named = self.named_sizes()
        if self.ep == 1:
            return named
        at = [n for n, _ in named].index("dp_shard")
        return named[:at] + [("dp_shard_mod_ep", self.dp_shard // self.ep), ("ep", self.ep)] + named[at + 1 :]

    def build_mesh(self, device_type: str) -> DeviceMesh | None:
        named = self.mesh_sizes()
        if not named:
            return None
        names, sizes = zip(*named)
        return init_device_mesh(device_type, tuple(sizes), mesh_dim_names=tuple(names))

    @property
    def fsdp_ranks(self) -> int:
        """Ranks FSDP2 shards the model over: dp_shard, times cp (context-parallel ranks train parts of the same
        rows, so their gradients are averaged together: torchtitan's dp_shard_cp)."""
        return self.dp_shard * self.cp

    def shard_mesh(self, mesh: DeviceMesh) -> DeviceMesh:
        """The mesh FSDP2 shards over: dp_shard (dp_replicate x dp_shard for HSDP); under EP, dp_shard_mod_ep x
        ep flattened; under CP, dp_shard x cp flattened (made once, then cached by the root mesh)."""
        names = mesh.mesh_dim_names
        if self.ep > 1:
            return mesh["dp_shard_mod_ep", "ep"]._flatten("dp_shard")
        if self.cp > 1:
            inner = tuple(n for n in ("dp_shard", "cp") if n in names)
            return mesh[inner]._flatten("dp_shard_cp") if len(inner) > 1 else mesh["cp"]
        return mesh[tuple(n for n in ("dp_replicate", "dp_shard") if n in names)]


def free_port() -> int:
    """A TCP port on this host that nothing listens on now (a local job's rendezvous, a rollout server)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(acc: Accelerator, d: DistributedConfig, extra_ranks: int = 0) -> int:
    """Join the torchrun job (if any); return the world size. Checks it against the recipe.

    ``extra_ranks`` > 0 (PPO's separated placement): the job has that many processes beyond
    ``distributed.world_size``; see :func:`split_world`.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != d.world_size + extra_ranks:
        extra = f" + {extra_ranks} for the reference and reward model (rlhf.scorer_ranks)" if extra_ranks else ""
        raise RecipeError(
            f"distributed.world_size={d.world_size}{extra} but this job has {world} process(es) "
            f"(WORLD_SIZE); launch with --nproc_per_node/--nnodes to match"
            + ("" if extra_ranks else f", or --set distributed.world_size={world}")
        )
    if world > 1 and not dist.is_initialized() and _exchange is None:
        enable_flight_recorder()  # a collective that times out is then named (runtime.watchdog)
        acc.set_device()
        timeout = timedelta(seconds=d.timeout_seconds)
        if extra_ranks:
            split_world(acc, d.world_size, timeout)
        else:
            dist.init_process_group(backend=acc.backend, timeout=timeout)
    return world


_exchange: tuple | None = None  # (gloo group over the whole job, this process's rank in it)


def split_world(acc: Accelerator, trained: int, timeout: timedelta) -> None:
    """Ranks [0, trained) form the default process group (the trained models' mesh, checkpoints,
    metrics: everything the trainer does collectively); the other ranks stay out of it. A separate gloo
    group over the whole job (:func:`exchange_group`) carries what passes between the two sides."""
    global _exchange
    store, global_rank, world = next(dist.rendezvous("env://", timeout=timeout))
    if global_rank < trained:
        dist.init_process_group(
            backend=acc.backend,
            store=dist.PrefixStore("trained/", store),
            rank=global_rank,
            world_size=trained,
            timeout=timeout,
        )
    _exchange = (dist.ProcessGroupGloo(dist.PrefixStore("exchange/", store), global_rank, world, timeout), global_rank)


def exchange_group() -> tuple:
    """(gloo group over the whole job, this process's rank in it), after :func:`split_world`."""
    if _exchange is None:
        raise RuntimeError("no exchange group: the job was not split (rlhf.device_placement: separated)")
    return _exchange


def rank() -> int:
    """This process's global rank; 0 outside a process group."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def from_rank0(value):
    """Rank 0's value of something each rank computed (a timestamped path, say); ``value`` outside a group."""
    if not (dist.is_available() and dist.is_initialized()):
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def dp_coordinates(mesh: DeviceMesh | None, dims: ParallelDims) -> tuple[int, int]:
    """(data-parallel rank, data-parallel size) of this process: which share of each batch it loads."""
    if mesh is None or dims.dp == 1:
        return 0, 1
    names = mesh.mesh_dim_names
    r = mesh.get_local_rank("dp_replicate") if "dp_replicate" in names else 0
    s = (dims.shard_mesh(mesh) if dims.ep > 1 else mesh["dp_shard"]).get_local_rank() if dims.dp_shard > 1 else 0
    return r * dims.dp_shard + s, dims.dp


def rank_coordinates(dims: ParallelDims) -> list[dict[str, int]]:
    """Each global rank's position on every mesh dimension (init_device_mesh lays ranks out row-major)."""
    names = ["pp", "dp_replicate", "dp_shard", "cp", "tp"]
    sizes = [dims.pp, dims.dp_replicate, dims.dp_shard, dims.cp, dims.tp]
    rows = []
    for rank in range(dims.world_size):
        coords, rest = {}, rank
        for name, size in zip(reversed(names), reversed(sizes)):
            coords[name] = rest % size
            rest //= size
        rows.append({"rank": rank, **{n: coords[n] for n in names}})
    return rows
