"""Checkpoints written with torch.distributed.checkpoint (DCP), atomically and verifiably.

Layout of ``checkpoints/step_N/``::

    .metadata, __0_0.distcp ...   model + optimizer, DCP format (the same format serves sharded runs)
    trainer_state_rank{R}.pt      step, scheduler, sampler and RNG states of rank R
    recipe.resolved.yaml          the recipe that wrote it
    manifest.json                 size and sha256 of every file above; written last

Everything is written into ``checkpoints/.tmp-step_N-*`` and renamed into place only when
complete, so a crash mid-save leaves no ``step_N`` behind. A directory without a manifest,
or whose files do not match it, is reported and skipped by ``resume_from: auto``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from canntrain_core.runtime.distributed import from_rank0, rank

MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete or corrupt; the message names the path and file."""


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _write_manifest(directory: Path, step: int) -> None:
    files = {
        str(p.relative_to(directory)): {"bytes": p.stat().st_size, "sha256": _sha256(p)}
        for p in sorted(directory.rglob("*"))
        if p.is_file() and p.name != MANIFEST
    }
    tmp = directory / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps({"step": step, "files": files}, indent=1))
    os.replace(tmp, directory / MANIFEST)


def verify_checkpoint(path: str | Path) -> dict[str, Any]:
    """Check a checkpoint against its manifest; return the manifest or raise CheckpointError."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint directory")
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(f"{path}: incomplete checkpoint (no {MANIFEST}; the save did not finish)")
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
    except (ValueError, KeyError) as e:
        raise CheckpointError(f"{manifest_path}: unreadable manifest ({e})") from None
    for name, want in files.items():
        f = path / name
        if not f.is_file():
            raise CheckpointError(f"{path}: file {name} listed in the manifest is missing")
        if f.stat().st_size != want["bytes"]:
            raise CheckpointError(
                f"{path}: file {name} is {f.stat().st_size} bytes, the manifest says {want['bytes']} (truncated?)"
            )
        if _sha256(f) != want["sha256"]:
            raise CheckpointError(f"{path}: file {name} is corrupt (sha256 does not match the manifest)")
    return manifest


def list_checkpoints(ckpt_root: str | Path) -> list[Path]:
    """step_N directories under ckpt_root, oldest first (complete or not)."""
    root = Path(ckpt_root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def latest_checkpoint(ckpt_root: str | Path) -> Path | None:
    """The newest checkpoint that verifies; broken ones are reported and skipped."""
    for path in reversed(list_checkpoints(ckpt_root)):
        try:
            verify_checkpoint(path)
            return path
        except CheckpointError as e:
            warnings.warn(f"skipping {e}", stacklevel=2)
    return None


def save_checkpoint(
    ckpt_root: str | Path,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    trainer_state: dict[str, Any],
    recipe_yaml: str,
    keep_last: int | None = None,
) -> Path:
    """Write checkpoints/step_{step} atomically; keep only the newest ``keep_last``."""
    root = Path(ckpt_root)
    final = root / f"step_{step}"
    if final.exists():
        raise CheckpointError(f"{final} already exists; refusing to overwrite it")
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(from_rank0(tempfile.mkdtemp(prefix=f".tmp-step_{step}-", dir=root) if rank() == 0 else None))

    state = {
        "model": get_model_state_dict(model),
        "optim": get_optimizer_state_dict(model, optimizer),
    }
    with warnings.catch_warnings():  # single-process saves are intended, not a misconfiguration
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, checkpoint_id=str(tmp))
    torch.save(trainer_state, tmp / f"trainer_state_rank{rank()}.pt")
    _barrier()
    if rank() == 0:
        (tmp / "recipe.resolved.yaml").write_text(recipe_yaml)
        _write_manifest(tmp, step)
        os.rename(tmp, final)  # atomic on one file system: step_N appears complete or not at all
        if keep_last:
            complete = [p for p in list_checkpoints(root) if (p / MANIFEST).is_file()]
            for old in complete[:-keep_last]:
                shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def load_checkpoint(path: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    verify: bool = True) -> dict[str, Any]:
    """Verify (unless the caller just did), then load model and optimizer in place; return this
    rank's trainer state."""
    path = Path(path)
    if verify:
        verify_checkpoint(path)
    state = {
        "model": get_model_state_dict(model),
        "optim": get_optimizer_state_dict(model, optimizer),
    }
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=str(path))
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optim"])
    rank_file = path / f"trainer_state_rank{rank()}.pt"
    if not rank_file.is_file():
        rank_file = path / "trainer_state_rank0.pt"  # fewer ranks wrote it; later issues reshard
    # Our own file, verified against the manifest above; it holds numpy RNG state, so not weights_only.
    return torch.load(rank_file, weights_only=False)
