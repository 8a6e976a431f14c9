"""GPU presets for the simulator: the peak numbers its roofline terms and KV sizing use.

Each preset is one GPU's bf16 dense tensor-core peak (no 2:4 sparsity), HBM bandwidth
and memory, from the vendor's data sheet:

* A100 80GB SXM: 312 TFLOP/s bf16 dense, 2039 GB/s HBM2e, 80 GB
  (NVIDIA A100 Tensor Core GPU data sheet, "A100 80GB SXM" column).
* H100 SXM5 80GB: 989 TFLOP/s bf16 dense (the sheet's 1979 is with sparsity),
  3.35 TB/s HBM3, 80 GB (NVIDIA H100 Tensor Core GPU data sheet, "H100 SXM" column).
* H200 SXM 141GB: 989 TFLOP/s bf16 dense, 4.8 TB/s HBM3e, 141 GB
  (NVIDIA H200 Tensor Core GPU data sheet, "H200 SXM" column).
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Hardware:
    """Peak numbers of one GPU. `link_bw`: bytes/s between pipeline stages (nodes);
    `allreduce_bw`: the NVLink bus bandwidth a ring all-reduce reaches."""

    name: str
    peak_flops: float
    mem_bw: float
    mem_bytes: float
    link_bw: float = 25e9  # 200 Gb/s InfiniBand between nodes
    link_latency_s: float = 10e-6
    allreduce_bw: float = 150e9

    def __post_init__(self) -> None:
        for name in ("peak_flops", "mem_bw", "mem_bytes", "link_bw", "allreduce_bw"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")


A100 = Hardware("a100", peak_flops=312e12, mem_bw=2039e9, mem_bytes=80e9)
H100 = Hardware("h100", peak_flops=989e12, mem_bw=3.35e12, mem_bytes=80e9, allreduce_bw=300e9)
H200 = Hardware("h200", peak_flops=989e12, mem_bw=4.8e12, mem_bytes=141e9, allreduce_bw=300e9)
HARDWARE = {hw.name: hw for hw in (A100, H100, H200)}


def get_hardware(name: str | Hardware) -> Hardware:
    """A preset by name (case-insensitive), or the given Hardware unchanged."""
    if isinstance(name, Hardware):
        return name
    try:
        return HARDWARE[str(name).lower()]
    except KeyError:
        raise ValueError(f"hardware must be one of {sorted(HARDWARE)}, got {name!r}") from None


def infer_hardware(profile_path: str | os.PathLike[str]) -> Hardware | None:
    """The preset a profile's file name names as a word (``h100_llama-2-7b_mlp.csv``,
    ``profiles/a100/mlp.csv``), or None when it names none or several."""
    words = set(re.split(r"[^a-z0-9]+", os.fspath(profile_path).lower()))
    found = [hw for name, hw in HARDWARE.items() if name in words]
    return found[0] if len(found) == 1 else None
