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

    def but(self, **changes: float) -> "DeviceSpec":
        return replace(self, **changes)


DEVICES: dict[str, DeviceSpec] = {
    "910b": DeviceSpec("Ascend 910B (64 GB)", 64 * GiB, 313e12, 196e9, 25e9),
    "a100-80g": DeviceSpec("A100 80 GB", 80 * GiB, 312e12, 300e9, 25e9),
    "h100-80g": DeviceSpec("H100 80 GB", 80 * GiB, 989e12, 450e9, 50e9),
    "h200": DeviceSpec("H200 141 GB", 141e9, 989e12, 450e9, 50e9),
}

_UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


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


def get_device(name: str) -> DeviceSpec:
    key = name.lower()
    if key not in DEVICES:
        raise ValueError(f"unknown device {name!r}; presets: {', '.join(DEVICES)}")
    return DEVICES[key]
