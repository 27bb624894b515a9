"""The eager backend: the reference ops themselves, on every device."""

from __future__ import annotations

from canntrain_kernels import reference
from canntrain_kernels.registry import OPS, Kernel, register

for _op in OPS:
    register(Kernel(_op, "eager", getattr(reference, _op), devices=("cpu", "cuda", "npu"), note="reference"))
