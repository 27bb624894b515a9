"""QLoRA's 4-bit base: bitsandbytes' NF4 (what peft's QLoRA uses) under a LoRA model's frozen linear layers.

``lora.load_in_4bit`` (transformers' ``BitsAndBytesConfig`` name): once the base is loaded in the recipe's 16-bit
precision, every linear layer of the decoder blocks (the adapted projections' base layers and the MLP's) becomes a
``bitsandbytes.nn.Linear4bit``: NF4 weights in blocks of 64 with double-quantized block scales (the QLoRA paper's
defaults), computed in ``model.precision``. The embedding, the norms and the output head stay 16-bit, the adapters
fp32. A checkpoint holds the adapters only, and a resume or an export reads the base from ``model.init_from`` again
(``--merge`` folds the adapters into those unquantized weights, as peft's ``merge_and_unload`` of a QLoRA model
dequantizes).

bitsandbytes 0.50 runs NF4 on CUDA and on the CPU (tested here); it has no Ascend backend, so an NPU run is refused
in one line. The base is materialized in 16 bits before it is quantized, layer by layer: loading needs the 16-bit
base's memory once.
"""

from __future__ import annotations

import torch

from canntrain_core.errors import BadInput
from canntrain_core.sizing.setup import NF4_BLOCK


def bitsandbytes_or_refuse(device_type: str):
    """bitsandbytes, or one line saying why a 4-bit base cannot run here."""
    if device_type == "npu":
        raise BadInput("lora.load_in_4bit: bitsandbytes has no Ascend (NPU) backend; use model.precision bf16")
    try:
        import bitsandbytes  # deferred: optional (bitsandbytes, QLoRA only)
    except ImportError as e:
        raise BadInput(f"lora.load_in_4bit needs bitsandbytes (pip install bitsandbytes): {e}") from None
    return bitsandbytes


def quantize_base_4bit(model: torch.nn.Module, compute_dtype: torch.dtype, device: torch.device) -> int:
    """Replace every frozen ``nn.Linear`` of ``model.layers()`` by bitsandbytes' NF4 ``Linear4bit``, in place;
    returns how many weights were quantized."""
    bnb = bitsandbytes_or_refuse(device.type)
    quantized = 0
    for layer in model.layers():
        for name, module in list(layer.named_modules()):
            if type(module) is not torch.nn.Linear or module.weight.requires_grad:
                continue
            parent_name, _, leaf = name.rpartition(".")
            parent = layer.get_submodule(parent_name) if parent_name else layer
            q = bnb.nn.Linear4bit(
                module.in_features,
                module.out_features,
                bias=module.bias is not None,
                compute_dtype=compute_dtype,
                compress_statistics=True,
                quant_type="nf4",
                device="meta",
            )
            q.weight = bnb.nn.Params4bit(
                module.weight.data, requires_grad=False, blocksize=NF4_BLOCK, compress_statistics=True, quant_type="nf4"
            ).to(device)
            if module.bias is not None:
                q.bias = module.bias
            # bitsandbytes repacks a CPU layer's weights in place for its inference kernel the first time it runs in
            # eval mode, and from then on trains through that kernel, which has no backward (an evaluation would
            # silently stop the gradients through the base); the training layout it keeps is autograd's.
            q.support_avx512bf16_for_cpu = False
            setattr(parent, leaf, q)
            quantized += module.weight.numel()
    return quantized
