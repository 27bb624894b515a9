"""Device presets: memory capacity, peak 16-bit FLOP/s and link bandwidths (bytes/s).

Figures are vendor datasheet numbers, rounded; the plan search uses them as parameters, and every
one can be overridden on the command line (``--device-memory``, ``--peak-tflops``, ...).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

GiB = 1024**3


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    memory_bytes: float
    peak_flops: float  # dense bf16/fp16
    intra_node_bw: float  # per device, within a node (HCCS / NVLink), one direction
    inter_node_bw: float  # per device, across nodes (RoCE / InfiniBand)
    match: str = ""  # how the runtime names it (torch.npu / torch.cuda get_device_name, lower case, no spaces)
    runtime: str = "cuda"  # the device type torch computes on there (npu through torch_npu)

    def but(self, **changes: float) -> "DeviceSpec":
        return replace(self, **changes)


DEVICES: dict[str, DeviceSpec] = {
    # 910B3, the common 910B SKU (910B1 is ~376 TFLOP/s)
    "910b": DeviceSpec("Ascend 910B (64 GB)", 64 * GiB, 313e12, 196e9, 25e9, match="910b", runtime="npu"),
    "a100-80g": DeviceSpec("A100 80 GB", 80 * GiB, 312e12, 300e9, 25e9, match="a100"),
    "h100-80g": DeviceSpec("H100 80 GB", 80 * GiB, 989e12, 450e9, 50e9, match="h100"),
    "h200": DeviceSpec("H200 141 GB", 141e9, 989e12, 450e9, 50e9, match="h200"),
}


def spec_of_device(name: str) -> DeviceSpec | None:
    """The preset of the device the runtime reports by ``name`` ('Ascend910B3', 'NVIDIA H100 80GB HBM3'), or
    None: the trainer's MFU and the planner read the same table."""
    key = name.lower().replace(" ", "")
    return next((spec for spec in DEVICES.values() if spec.match and spec.match in key), None)


_UNITS = {
    "": 1,
    "b": 1,
    "kb": 1e3,
    "mb": 1e6,
    "gb": 1e9,
    "tb": 1e12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_bytes(text: str | float | int) -> float:
    """'64GiB', '80 GB', '1.5e9' or a preset name ('910b') -> bytes. GB is 10^9, GiB is 2^30."""
    if isinstance(text, (int, float)):
        return float(text)
    t = str(text).strip().lower()
    if t in DEVICES:
        return DEVICES[t].memory_bytes
    m = re.fullmatch(r"([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmgt]?i?b?)", t)
    if not m or m.group(2) not in _UNITS:
        raise ValueError(f"device memory {text!r}: expected e.g. 64GiB, 80GB or a preset ({', '.join(DEVICES)})")
    return float(m.group(1)) * _UNITS[m.group(2)]


def bytes_text(n: float) -> str:
    """A size as people read it: "13.45 GiB", "5.1 MiB", "4.0 KiB", "12 B" (binary units)."""
    for unit, scale, digits in (("GiB", 2**30, 2), ("MiB", 2**20, 1), ("KiB", 2**10, 1)):
        if n >= scale:
            return f"{n / scale:.{digits}f} {unit}"
    return f"{n:.0f} B"


def get_device(name: str) -> DeviceSpec:
    key = name.lower()
    if key not in DEVICES:
        raise ValueError(f"unknown device {name!r}; presets: {', '.join(DEVICES)}")
    return DEVICES[key]
