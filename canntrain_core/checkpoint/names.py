"""Parameter names without the modules wrappers insert: what a checkpoint's and a Hugging Face directory's names
are matched on."""

from __future__ import annotations

# Module names a wrapper inserts into parameter names; Hugging Face names are the names without them
# (activation checkpointing, torch.compile, FSDP1, and peft's LoRA layer around a base projection).
WRAPPERS = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.", "base_layer.")


def hf_name(name: str) -> str:
    """The Hugging Face name of one of our parameters (``named_parameters`` of a parallelized CausalLM)."""
    for wrapper in WRAPPERS:
        name = name.replace(wrapper, "")
    return name
