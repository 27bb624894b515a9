"""Activation checkpointing: recompute a decoder layer's activations in backward instead of storing them.

full: every layer; selective: every other layer (half the activation memory saved, a third of the
recompute cost), as torchtitan's layer-frequency option.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper


def apply_recompute(model, mode: str) -> None:
    if mode == "none":
        return
    every = 1 if mode == "full" else 2
    layers = model.model.layers
    keys = list(layers.keys()) if isinstance(layers, nn.ModuleDict) else list(range(len(layers)))
    for n, key in enumerate(keys):
        if n % every == 0:
            layers[key] = checkpoint_wrapper(layers[key], preserve_rng_state=False)
