"""Backends: each module registers its kernels with kernels.registry on import.

``eager`` (the reference), ``compile`` (torch.compile of the reference), ``npu`` (torch_npu fused
ops) and ``cuda`` (Triton kernels and torch's fused SDPA). Importing any of them is safe on any
machine: a missing library or device only makes its kernels unavailable, with a reason.
"""
