"""canntrain's fused kernels: RMSNorm, RoPE, SwiGLU, attention, chunked cross-entropy, a mixture of experts' MLP and a
ring attention's block (``block_attention``).

One registry, several backends per op (``npu``: torch_npu fused ops, ``cuda``: Triton and torch's
flash SDPA, ``cpu``: torch's fused CPU kernels, ``compile``: torch.compile of the reference, ``eager``: the
reference itself), and a
harness that checks each against an fp64 reference and times it::

    import canntrain_kernels as kernels
    rms_norm = kernels.get("rms_norm", "auto")     # fastest available backend that passed its check
    kernels.available_backends("attention")         # e.g. ['compile', 'eager'] on a CPU
    records = kernels.run_check(ops=["swiglu"], dtypes=["fp32", "bf16"])

From the shell: ``canntrain kernels check --ops swiglu --dtypes fp32,bf16``.
(Not named ``kernels``: that is the hub's kernel library, which transformers imports when installed.)
"""

from canntrain_kernels import reference
from canntrain_kernels.check import TOLERANCES, Record, check_one, format_table, run_check
from canntrain_kernels.registry import (
    BACKENDS,
    CHOICES,
    OPS,
    KernelUnavailable,
    Selection,
    available_backends,
    get,
    resolve,
    select,
    unavailable_reason,
)

__all__ = [
    "BACKENDS",
    "CHOICES",
    "OPS",
    "TOLERANCES",
    "KernelUnavailable",
    "Record",
    "Selection",
    "available_backends",
    "check_one",
    "format_table",
    "get",
    "reference",
    "resolve",
    "run_check",
    "select",
    "unavailable_reason",
]
