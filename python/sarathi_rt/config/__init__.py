"""One config tree for every entry point: `EngineConfig` composes the sections (model,
scheduler, KV cache, its size, parallelism), each field declared once with its default,
check and help; `flags` builds every command's flags from those fields, `budget` holds
the commands' token budget rule and `reference` writes docs/configuration.md."""
from sarathi_rt.scheduler.config import (ADAPTIVE_CAP, DEFAULT_MAX_NUM_SEQS, DEFAULT_TOKEN_BUDGET, CacheOptions,
                                         SchedulerConfig, SchedulingOptions, resolve_token_budget)

from .tree import DEFAULT_MODEL, SECTIONS, EngineConfig, MemoryOptions, ModelOptions, ParallelOptions

__all__ = ["ADAPTIVE_CAP", "DEFAULT_MAX_NUM_SEQS", "DEFAULT_MODEL", "DEFAULT_TOKEN_BUDGET", "SECTIONS", "CacheOptions",
           "EngineConfig", "MemoryOptions", "ModelOptions", "ParallelOptions", "SchedulerConfig", "SchedulingOptions",
           "resolve_token_budget"]
