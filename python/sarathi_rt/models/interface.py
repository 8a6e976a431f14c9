"""What the engine and the tools that time it may ask of a model stage, whatever its
family: the engine's worker and model runner and the step-split timers talk to this, not
to one family's layers, so a new family needs no change above `models/`."""
from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

from .config import ModelConfig
from .context import StepContext
from .parallel import BoundLayout

if TYPE_CHECKING:  # the engine owns the cache; a model only binds to it
    from sarathi_rt.ops.kv_cache import KVCache


class CausalLM(Protocol):
    """One pipeline stage (tensor rank) of a decoder. `shard` is its place in the
    parallel layout (its layers, heads and vocabulary slice); `device` is where its
    weights live."""

    config: ModelConfig
    dtype: torch.dtype
    shard: BoundLayout

    @property
    def device(self) -> torch.device: ...

    def bind_kv_cache(self, cache: KVCache) -> None:
        """Attend over `cache` (its layer j is this stage's j-th layer) from now on."""

    def __call__(self, ctx: StepContext, input_ids: torch.Tensor | None = None,
                 intermediate: tuple[torch.Tensor, torch.Tensor | None] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run this stage's layers: token ids on the first stage, the previous stage's
        (hidden, residual) after it; returns (hidden, residual)."""

    def compute_logits(self, hidden: torch.Tensor, residual: torch.Tensor | None,
                       ctx: StepContext) -> torch.Tensor | None:
        """float32 logits of the rows in ctx.logits_indices (the last stage only; None on
        tensor ranks other than 0)."""

    def timed_regions(self) -> Iterator[tuple[str, nn.Module]]:
        """(category, module) for every module whose `forward` a step split times on its
        own: "linear" for each GEMM, "attention"
        for each attention block less its projections (rotary, KV write, the kernel).
        What they leave out (norms, activations, glue) counts as the model's "other"."""
