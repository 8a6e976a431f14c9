"""Where one worker sits in a tensor x pipeline parallel layout, and the sharding math
that follows from it. Every other module asks this one which slice it owns."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import ModelConfig


@dataclass(frozen=True)
class ParallelLayout:
    """Tensor parallelism splits attention heads and the MLP's intermediate dimension
    over `tp_size` ranks (column-parallel qkv/gate_up, row-parallel o/down followed by an
    all-reduce); embeddings and lm_head stay whole on every rank. Pipeline parallelism
    gives this stage the decoder layers [layer_start, layer_end)."""

    tp_rank: int = 0
    tp_size: int = 1
    layer_start: int = 0
    layer_end: int | None = None  # None: through the last layer

    def __post_init__(self) -> None:
        if not isinstance(self.tp_size, int) or self.tp_size < 1:
            raise ValueError(f"tp_size must be a positive int, got {self.tp_size!r}")
        if not isinstance(self.tp_rank, int) or not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank must be in [0, tp_size={self.tp_size}), got {self.tp_rank!r}")
        if not isinstance(self.layer_start, int) or self.layer_start < 0:
            raise ValueError(f"layer_start must be an int >= 0, got {self.layer_start!r}")
        if self.layer_end is not None and self.layer_end <= self.layer_start:
            raise ValueError(f"layer_end ({self.layer_end}) must exceed layer_start ({self.layer_start})")

    def bind(self, config: ModelConfig) -> BoundLayout:
        """Check this layout against a model and resolve the layer range."""
        end = config.num_hidden_layers if self.layer_end is None else self.layer_end
        if end > config.num_hidden_layers:
            raise ValueError(f"layer_end ({end}) exceeds num_hidden_layers ({config.num_hidden_layers})")
        for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
            if getattr(config, name) % self.tp_size:
                raise ValueError(f"{name} ({getattr(config, name)}) must be divisible by tp_size ({self.tp_size})")
        return BoundLayout(self, config, end)


class BoundLayout:
    """A layout resolved against one model: local sizes and weight slices."""

    def __init__(self, layout: ParallelLayout, config: ModelConfig, layer_end: int) -> None:
        self.layout = layout
        self.layers = range(layout.layer_start, layer_end)
        self.is_first = layout.layer_start == 0
        self.is_last = layer_end == config.num_hidden_layers
        tp = layout.tp_size
        self.num_heads = config.num_attention_heads // tp
        self.num_kv_heads = config.num_key_value_heads // tp
        self.intermediate = config.intermediate_size // tp
        self.head_dim = config.head_dim
        self.tp_rank, self.tp_size = layout.tp_rank, tp

    def _rows(self, per_rank: int) -> slice:
        return slice(self.tp_rank * per_rank, (self.tp_rank + 1) * per_rank)

    def column_slice(self, kind: str) -> slice:
        """Output rows of a column-parallel weight (or bias) this rank keeps."""
        per_rank = {"q": self.num_heads * self.head_dim, "k": self.num_kv_heads * self.head_dim,
                    "v": self.num_kv_heads * self.head_dim, "gate": self.intermediate, "up": self.intermediate}
        return self._rows(per_rank[kind])

    def row_slice(self, kind: str) -> slice:
        """Input columns of a row-parallel weight this rank keeps."""
        per_rank = {"o": self.num_heads * self.head_dim, "down": self.intermediate}
        return self._rows(per_rank[kind])

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """Sum a row-parallel layer's partial outputs over the tensor-parallel group."""
        if self.tp_size > 1:
            torch.distributed.all_reduce(partial)
        return partial
