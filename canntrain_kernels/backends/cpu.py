"""The cpu backend: torch's fused CPU kernels where the reference would materialise what they do not.

Only a ring attention's block (``attention_block``): the flash attention for CPU that SDPA dispatches to, which
returns the log-sum-exp and has a backward taking it (``canntrain_kernels.block_attention.cpu_block_attention``).
"""

from __future__ import annotations

from canntrain_kernels.block_attention import cpu_block_attention, cpu_probe
from canntrain_kernels.registry import Kernel, register

register(
    Kernel("attention_block", "cpu", cpu_block_attention, devices=("cpu",), probe=cpu_probe, note="aten flash (CPU)")
)
