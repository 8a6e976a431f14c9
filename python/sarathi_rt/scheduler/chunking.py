"""Chunk sizing from the Sarathi paper."""
from __future__ import annotations


def suggest_chunk_size(pd_ratio: float, batch_size: int, tile_size: int | None = 128) -> int:
    """Prefill chunk C for decode-maximal batching of `batch_size` (B) requests.

    Sarathi pairs one chunk with B - 1 decodes; with a workload whose prompt:decode
    token ratio is P:D, every decode gets a chunk to ride on when C = P/D * (B - 1).
    With `tile_size`, C is moved to the nearest value that makes C + (B - 1) a tile
    multiple (the paper's "chunk = tile multiple - decodes"), since a step of
    tile * k + 1 tokens costs a whole extra tile.
    """
    if not pd_ratio > 0:
        raise ValueError(f"pd_ratio must be > 0, got {pd_ratio!r}")
    if not isinstance(batch_size, int) or batch_size < 2:
        raise ValueError(f"batch_size must be an int >= 2, got {batch_size!r}")
    decodes = batch_size - 1
    chunk = max(1, round(pd_ratio * decodes))
    if not tile_size:
        return chunk
    if not isinstance(tile_size, int) or tile_size <= 0:
        raise ValueError(f"tile_size must be a positive int or None, got {tile_size!r}")
    tiles = max(1, round((chunk + decodes) / tile_size))
    while tiles * tile_size <= decodes:  # C must stay >= 1
        tiles += 1
    return tiles * tile_size - decodes
