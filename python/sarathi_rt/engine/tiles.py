"""The scheduler's tile size: given, or "auto" from the GEMM plan of the model's widest
projection at a full token budget."""
from __future__ import annotations

from sarathi_rt import ops
from sarathi_rt.models import ModelConfig

from .config import EngineConfig


def resolve_tile_size(tile_size: int | str | None, model: ModelConfig, config: EngineConfig) -> int | None:
    if tile_size != "auto":
        return tile_size  # type: ignore[return-value]
    gemm_plan = getattr(ops, "gemm_plan", None)
    if gemm_plan is None or config.device.type != "cuda":
        return None  # CPU GEMMs have no tile staircase worth aligning the batch to
    plan = gemm_plan(config.token_budget, 2 * model.intermediate_size, model.hidden_size, config.dtype,
                     config.device)
    return int(plan.tile_m)
