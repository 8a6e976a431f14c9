"""How many KV blocks the engine gets by default: what it can ever use (max_num_seqs
requests of max_model_len tokens), capped by free memory times a fraction and, on the
CPU, by CPU_KV_CACHE_BYTES."""
from __future__ import annotations

import os

import torch

from sarathi_rt.ops.kv_cache import KVCacheShape

CPU_FRACTION = 0.5
CUDA_FRACTION = 0.9
# A CPU serves few requests at a time; past this, a larger cache only costs address
# space and start-up. Pass num_kv_blocks (or kv_memory_fraction) for more.
CPU_KV_CACHE_BYTES = 4 << 30


def available_bytes(device: torch.device) -> int:
    """Free memory: torch.cuda.mem_get_info on a GPU; MemAvailable on a Linux host
    (else the OS's count of available physical pages)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def auto_num_blocks(shape: KVCacheShape, device: torch.device, max_num_seqs: int, max_model_len: int,
                    fraction: float | None = None) -> int:
    """max_num_seqs full-length requests' worth of blocks, at most what fits in `fraction`
    of free memory; on the CPU without an explicit fraction also at most CPU_KV_CACHE_BYTES."""
    cpu_cap = device.type == "cpu" and fraction is None
    if fraction is None:
        fraction = CUDA_FRACTION if device.type == "cuda" else CPU_FRACTION
    budget = int(available_bytes(device) * fraction)
    if cpu_cap:
        budget = min(budget, CPU_KV_CACHE_BYTES)
    fits = shape.blocks_for_memory(budget)
    needed = max_num_seqs * -(-max_model_len // shape.block_size)
    if fits < 1:
        raise ValueError(f"no room for a single KV block ({shape.bytes_per_block} bytes) in "
                         f"{budget / 2**30:.2f} GiB ({fraction:.0%} of what is free on {device}); "
                         "pass num_kv_blocks")
    return min(fits, needed)
