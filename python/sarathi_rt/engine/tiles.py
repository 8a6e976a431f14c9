"""The scheduler's tile size: given, or "auto": the M tile of the GEMM plan for the
model's widest projection (gate_up), which is what a step's token count should fill."""
from __future__ import annotations

from sarathi_rt import ops
from sarathi_rt.models import ModelConfig

from sarathi_rt.config import EngineConfig


def resolve_tile_size(tile_size: int | str | None, model: ModelConfig, config: EngineConfig) -> int | None:
    if tile_size != "auto":
        return tile_size  # type: ignore[return-value]
    if config.device.type != "cuda":
        return None  # torch's CPU GEMMs have no tile staircase worth aligning the batch to
    return ops.gemm_tile_size(2 * model.intermediate_size, model.hidden_size, config.dtype, config.device)
