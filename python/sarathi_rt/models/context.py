"""The per-step batch metadata every layer reads: built once by the ModelRunner."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from sarathi_rt.ops import AttentionPlan


@dataclass(frozen=True)
class StepContext:
    """Tensors on the model's device for one step over `num_tokens` tokens of `batch`
    requests laid out back to back.

    positions, slot_mapping: int64 [num_tokens]; cu_seqlens_q: int32 [batch + 1];
    seqlens_k: int32 [batch] (cached tokens, this step's included); block_tables:
    int32 [batch, max_blocks]; logits_indices: int64 [rows that sample a token];
    attention_plan: the step's hybrid-attention work list, shared by every layer (of
    its window); other_plans: one more per other sliding window the model's layers use
    (a plan is made for one window: Gemma's local and global layers need two).
    """

    positions: torch.Tensor
    slot_mapping: torch.Tensor
    cu_seqlens_q: torch.Tensor
    seqlens_k: torch.Tensor
    block_tables: torch.Tensor
    logits_indices: torch.Tensor
    attention_plan: AttentionPlan
    other_plans: tuple[AttentionPlan, ...] = ()

    def plan_for(self, window: int) -> AttentionPlan:
        """The step's plan for a layer with this sliding window (0 = full attention)."""
        if self.attention_plan.window == window:
            return self.attention_plan
        for plan in self.other_plans:
            if plan.window == window:
                return plan
        raise ValueError(f"the step has no attention plan for window {window}")

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])
