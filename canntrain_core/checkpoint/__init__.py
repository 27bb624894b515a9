"""Atomic, verified DCP checkpoints: save, find the newest complete one, load."""

from canntrain_core.checkpoint.dcp import (
    CheckpointError,
    checkpoint_config,
    checkpoint_recipe,
    clean_interrupted,
    complete_checkpoints,
    find_resumable,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
    set_aside,
    verify_checkpoint,
)

__all__ = [
    "CheckpointError",
    "checkpoint_config",
    "checkpoint_recipe",
    "clean_interrupted",
    "complete_checkpoints",
    "find_resumable",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "save_checkpoint",
    "set_aside",
    "verify_checkpoint",
]
