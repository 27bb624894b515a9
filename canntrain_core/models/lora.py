"""LoRA through peft, a model transform: adapters injected into the (meta) transformers model, the base frozen.

``lora: {enabled, rank, alpha, dropout, target_modules}`` puts peft's ``lora.Linear`` around each
target projection (default q/k/v/o). Only ``lora_A``/``lora_B`` train and enter the optimizer;
checkpoints hold only them (the base comes from ``model.init_from`` on every start and resume).
The adapter's initial values follow peft's: A uniform in +-1/sqrt(fan_in) (kaiming-uniform with
a = sqrt 5), B zero, so the adapted model starts as the base; here A is drawn per parameter from
the recipe seed (``models.init``), so it does not depend on the layout.

``canntrain export RUN_DIR -o DIR`` then writes the adapter in peft's own format (adapter_config.json
+ adapter_model.safetensors, ``PeftModel.from_pretrained`` loads it) and ``--merge`` a plain Hugging
Face model with W + (alpha / rank) B A folded in.
"""

from __future__ import annotations

import logging
import warnings

import torch
from transformers import AutoModelForCausalLM

from canntrain_core.models.registry import count_parameters


# peft imports bitsandbytes whenever it is installed; on a CPU with AVX512-BF16 that import tries to fetch a kernel from
# the Hugging Face hub (canntrain never downloads at run time) and logs the failure, though bitsandbytes' own kernel
# then runs: nothing a reader can act on.
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)


def is_adapter(name: str) -> bool:
    return "lora_A" in name or "lora_B" in name


def peft_config(lora, base: str | None = None):
    # deferred: start-up time (peft, ~0.2 s, for LoRA only; canntrain --help imports this module)
    from peft import LoraConfig

    return LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
        base_model_name_or_path=base,
    )


def apply_lora(hf_model: torch.nn.Module, lora) -> None:
    """Inject peft's LoRA layers into ``hf_model`` in place and freeze everything else."""
    # deferred: start-up time (peft, ~0.2 s, for LoRA only; canntrain --help imports this module)
    from peft import inject_adapter_in_model

    inject_adapter_in_model(peft_config(lora), hf_model)
    for name, p in hf_model.named_parameters():
        p.requires_grad_(is_adapter(name))


def has_adapters(model: torch.nn.Module) -> bool:
    """Whether ``model`` carries LoRA adapters: what trains, checkpoints and exports then is the adapters."""
    return any(is_adapter(name) for name, _ in model.named_parameters())


def adapter_summary(model: torch.nn.Module) -> str:
    """ "rank R on q_proj, v_proj" from the adapters in ``model`` (peft's ``lora.Linear`` modules)."""
    ranks, targets = set(), []
    for name, module in model.named_modules():
        if hasattr(module, "lora_A") and hasattr(module, "r"):
            ranks.update(module.r.values())
            leaf = name.rsplit(".", 1)[-1]
            if leaf not in targets:
                targets.append(leaf)
    return f"rank {', '.join(map(str, sorted(ranks)))} on {', '.join(targets)}"


def trainable_summary(model: torch.nn.Module) -> str:
    """peft's ``print_trainable_parameters`` line (DTensor parameters counted whole)."""
    trainable, total = count_parameters(model, trainable_only=True), count_parameters(model)
    return f"trainable params: {trainable:,} || all params: {total:,} || trainable%: {100 * trainable / total:.4f}"


def peft_key(name: str) -> str:
    """Our adapter parameter name -> the key peft's adapter_model.safetensors uses."""
    return "base_model.model." + name.replace(".default", "")


def load_with_peft(base_dir, adapter_dir):
    """transformers' model of ``base_dir`` with peft's ``PeftModel.from_pretrained`` adapter on top, in
    eval mode (peft's own loader; the deprecation warning it triggers inside transformers is not ours
    to act on)."""
    # deferred: start-up time (peft, ~0.2 s, for LoRA only; canntrain --help imports this module)
    from peft import PeftModel

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*is deprecated", category=FutureWarning)
        return PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), adapter_dir).eval()
