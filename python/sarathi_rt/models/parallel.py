"""Where one worker sits in a tensor x pipeline parallel layout, and the sharding math
that follows from it. Every other module asks this one which slice it owns."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from sarathi_rt.utils.checks import positive_int

from .config import ModelConfig


@dataclass(frozen=True)
class ParallelLayout:
    """Tensor parallelism splits attention heads and the MLP's intermediate dimension
    over `tp_size` ranks (column-parallel qkv/gate_up, row-parallel o/down followed by an
    all-reduce), and the vocabulary of the embedding and lm_head (Megatron's
    vocab-parallel layers). When tp_size exceeds the KV heads (and is a multiple of
    them), each KV head is replicated on tp_size / num_key_value_heads neighbouring ranks:
    every rank keeps the one KV head its query heads read. Pipeline parallelism gives this stage the decoder layers
    [layer_start, layer_end). `tp_group` is the torch.distributed group of this stage's
    tensor-parallel ranks (None: the default group); `tp_root` is the global rank of
    its tensor rank 0, which receives the gathered logits."""

    tp_rank: int = 0
    tp_size: int = 1
    layer_start: int = 0
    layer_end: int | None = None  # None: through the last layer
    tp_group: Any = field(default=None, compare=False, repr=False)
    tp_root: int = 0

    def __post_init__(self) -> None:
        positive_int("tp_size", self.tp_size)
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
        for name in ("num_attention_heads", "intermediate_size"):
            if getattr(config, name) % self.tp_size:
                raise ValueError(f"{name} ({getattr(config, name)}) must be divisible by tp_size ({self.tp_size})")
        kv = config.num_key_value_heads
        if kv % self.tp_size and self.tp_size % kv:
            raise ValueError(f"num_key_value_heads ({kv}) must divide or be a multiple of tp_size ({self.tp_size})")
        if config.vocab_size < self.tp_size:
            raise ValueError(f"vocab_size ({config.vocab_size}) must be at least tp_size ({self.tp_size})")
        return BoundLayout(self, config, end)


def stage_layers(num_layers: int, num_stages: int, stage: int) -> range:
    """The decoder layers of pipeline stage `stage`: equal, contiguous slices, so that
    equal micro-batches keep every stage equally busy."""
    if num_layers % num_stages:
        raise ValueError(f"pipeline_parallel_size ({num_stages}) must divide num_hidden_layers ({num_layers})")
    per_stage = num_layers // num_stages
    return range(stage * per_stage, (stage + 1) * per_stage)


class BoundLayout:
    """A layout resolved against one model: local sizes and weight slices."""

    def __init__(self, layout: ParallelLayout, config: ModelConfig, layer_end: int) -> None:
        self.layout = layout
        self.layers = range(layout.layer_start, layer_end)
        self.is_first = layout.layer_start == 0
        self.is_last = layer_end == config.num_hidden_layers
        tp = layout.tp_size
        self.num_heads = config.num_attention_heads // tp
        # kv_replicas ranks share each KV head; query heads stay split evenly, and the
        # query heads of one rank then all belong to the rank's one KV head.
        self.kv_replicas = max(1, tp // config.num_key_value_heads)
        self.num_kv_heads = max(1, config.num_key_value_heads // tp)
        self.kv_head_start = (layout.tp_rank // self.kv_replicas) * self.num_kv_heads
        self.intermediate = config.intermediate_size // tp
        self.head_dim = config.head_dim
        self.tp_rank, self.tp_size = layout.tp_rank, tp
        # Every rank but the last owns ceil(vocab / tp) rows; gathered logits are padded
        # to that width per rank, then cut back to vocab_size.
        self.vocab_size = config.vocab_size
        self.vocab_per_rank = -(-config.vocab_size // tp)
        start = min(self.tp_rank * self.vocab_per_rank, config.vocab_size)
        self.vocab = range(start, min(start + self.vocab_per_rank, config.vocab_size))

    def _rows(self, per_rank: int) -> slice:
        return slice(self.tp_rank * per_rank, (self.tp_rank + 1) * per_rank)

    def column_slice(self, kind: str) -> slice:
        """Output rows of a column-parallel weight (or bias) this rank keeps."""
        if kind in ("k", "v"):
            return slice(self.kv_head_start * self.head_dim,
                         (self.kv_head_start + self.num_kv_heads) * self.head_dim)
        per_rank = {"q": self.num_heads * self.head_dim, "gate": self.intermediate, "up": self.intermediate}
        return self._rows(per_rank[kind])

    def row_slice(self, kind: str) -> slice:
        """Input columns of a row-parallel weight this rank keeps."""
        per_rank = {"o": self.num_heads * self.head_dim, "down": self.intermediate}
        return self._rows(per_rank[kind])

    def vocab_slice(self) -> slice:
        """Rows of the embedding / lm_head (vocabulary entries) this rank keeps."""
        return slice(self.vocab.start, self.vocab.stop)

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """Sum a row-parallel layer's partial outputs over the tensor-parallel group."""
        if self.tp_size > 1:
            dist.all_reduce(partial, group=self.layout.tp_group)
        return partial

    def embed(self, input_ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """Vocab-parallel lookup: rows outside this rank's slice read as zero, and the
        all-reduce adds the one rank's row that holds each id (zeros add exactly)."""
        if self.tp_size == 1:
            return torch.nn.functional.embedding(input_ids, table)
        local = input_ids - self.vocab.start
        outside = (local < 0) | (local >= len(self.vocab))
        out = torch.nn.functional.embedding(local.masked_fill(outside, 0), table)
        out.masked_fill_(outside.unsqueeze(1), 0)
        return self.reduce(out)

    def gather_logits(self, local: torch.Tensor) -> torch.Tensor | None:
        """[rows, this rank's vocab] -> [rows, vocab] on the tensor-parallel root (the
        rank that samples); None on the other ranks."""
        if self.tp_size == 1:
            return local
        rows, width = local.shape[0], self.vocab_per_rank
        padded = local.new_zeros(rows, width)
        padded[:, :local.shape[1]] = local
        is_root = self.tp_rank == 0
        parts = [torch.empty_like(padded) for _ in range(self.tp_size)] if is_root else None
        dist.gather(padded, parts, dst=self.layout.tp_root, group=self.layout.tp_group)
        return torch.cat(parts, dim=1)[:, :self.vocab_size] if parts is not None else None
