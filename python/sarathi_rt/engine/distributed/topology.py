"""Which (pipeline stage, tensor rank) each worker rank is, and whether a model can be
split that way. Rank r is stage r // tp, tensor rank r % tp: a stage's tensor-parallel
ranks are neighbours, and rank r sends its activations to rank r + tp."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sarathi_rt.models import ModelConfig, ParallelLayout
from sarathi_rt.models.parallel import stage_layers
from sarathi_rt.utils.checks import positive_int


@dataclass(frozen=True)
class Topology:
    tp: int
    pp: int

    def __post_init__(self) -> None:
        positive_int("tensor_parallel_size", self.tp)
        positive_int("pipeline_parallel_size", self.pp)

    @property
    def world_size(self) -> int:
        return self.tp * self.pp

    def stage(self, rank: int) -> int:
        return rank // self.tp

    def tp_rank(self, rank: int) -> int:
        return rank % self.tp

    def stage_ranks(self, stage: int) -> list[int]:
        return list(range(stage * self.tp, (stage + 1) * self.tp))

    def describe(self, rank: int) -> str:
        return f"rank {rank} (pipeline stage {self.stage(rank)}, tensor rank {self.tp_rank(rank)})"

    def check(self, config: ModelConfig) -> None:
        """Raise ValueError naming the size that does not split `config`."""
        for name in ("num_attention_heads", "intermediate_size"):
            value = getattr(config, name)
            if value % self.tp:
                raise ValueError(f"tensor_parallel_size ({self.tp}) must divide {name} ({value})")
        kv = config.num_key_value_heads
        if kv % self.tp and self.tp % kv:  # more ranks than KV heads: each head is replicated
            raise ValueError(f"tensor_parallel_size ({self.tp}) must divide num_key_value_heads ({kv}) "
                             f"or be a multiple of it")
        if config.vocab_size < self.tp:
            raise ValueError(f"tensor_parallel_size ({self.tp}) exceeds vocab_size ({config.vocab_size})")
        if config.num_hidden_layers % self.pp:
            raise ValueError(f"pipeline_parallel_size ({self.pp}) must divide num_hidden_layers "
                             f"({config.num_hidden_layers})")

    def layout(self, rank: int, config: ModelConfig, tp_group: Any = None) -> ParallelLayout:
        layers = stage_layers(config.num_hidden_layers, self.pp, self.stage(rank))
        return ParallelLayout(tp_rank=self.tp_rank(rank), tp_size=self.tp, layer_start=layers.start,
                              layer_end=layers.stop, tp_group=tp_group,
                              tp_root=self.stage_ranks(self.stage(rank))[0])
