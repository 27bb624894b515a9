"""The eager backend: the reference ops themselves, on every device."""

from __future__ import annotations

from canntrain_kernels import reference
from canntrain_kernels.block_attention import eager_block_attention
from canntrain_kernels.registry import OPS, Kernel, register

for _op in OPS:
    # a ring's block is a forward and a backward (tiled matmuls); the reference is its plain definition
    _fn = eager_block_attention if _op == "attention_block" else getattr(reference, _op)
    register(Kernel(_op, "eager", _fn, devices=("cpu", "cuda", "npu"), note="reference"))
