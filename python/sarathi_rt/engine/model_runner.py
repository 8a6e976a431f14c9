"""StepInput -> logits: builds the step context once, then runs the model."""
from __future__ import annotations

import torch

from sarathi_rt import ops
from sarathi_rt.models import LlamaForCausalLM, StepContext

from .step_io import StepInput


class ModelRunner:
    """`max_batch` / `max_tokens` size the attention plan's buffers (a larger step
    grows them). The plan feeds the CUDA kernel; the CPU kernel ignores plans, so on the
    CPU one is built only when `use_attention_plan` asks for it (tests do)."""

    def __init__(self, model: LlamaForCausalLM, block_size: int, max_batch: int = 1,
                 max_tokens: int = 1, use_attention_plan: bool | None = None) -> None:
        self.model = model
        self.block_size = block_size
        self.device = model.cos_sin_cache.device
        self.vocab_size = model.config.vocab_size
        self.max_position = model.config.max_position_embeddings
        self.use_attention_plan = self.device.type == "cuda" if use_attention_plan is None else use_attention_plan
        self._plan: ops.AttentionPlan | None = None
        self._plan_size = (max_batch, max_tokens)

    def prepare(self, step: StepInput) -> tuple[torch.Tensor, StepContext]:
        """Token ids and the per-step context every layer reads."""
        if not step.chunks:
            raise ValueError("step has no chunks")
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        cu_seqlens = [0]
        seqlens_k: list[int] = []
        logits_rows: list[int] = []
        width = max(len(c.block_table) for c in step.chunks)
        tables = [c.block_table + [0] * (width - len(c.block_table)) for c in step.chunks]
        for c in step.chunks:
            n, start = len(c.token_ids), c.start_pos
            end = start + n
            if n == 0 or start < 0:
                raise ValueError(f"request {c.request_id!r}: empty chunk or negative start_pos")
            if end > self.max_position:
                raise ValueError(f"request {c.request_id!r} reaches position {end - 1}, beyond the model's "
                                 f"max_position_embeddings ({self.max_position})")
            # Too short a table would be padded with block 0 below; block ids themselves are
            # range-checked by write_kv and hybrid_attention (or the attention plan).
            if len(c.block_table) * bs < end:
                raise ValueError(f"request {c.request_id!r}: block_table {c.block_table} does not map "
                                 f"positions 0..{end - 1} into blocks of {bs}")
            ids.extend(c.token_ids)
            table = c.block_table
            for pos in range(start, end):
                positions.append(pos)
                slots.append(table[pos // bs] * bs + pos % bs)
            cu_seqlens.append(cu_seqlens[-1] + n)
            seqlens_k.append(end)
            if c.sampling is not None:
                logits_rows.append(cu_seqlens[-1] - 1)
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            raise ValueError(f"token ids must be in [0, {self.vocab_size})")

        def tensor(values: list[int] | list[list[int]], dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype).to(self.device, non_blocking=True)

        host = [torch.tensor(v, dtype=torch.int32) for v in (cu_seqlens, seqlens_k, tables)]
        cu_seqlens_q, seqlens_k_t, block_tables = (t.to(self.device, non_blocking=True) for t in host)
        ctx = StepContext(positions=tensor(positions, torch.int64), slot_mapping=tensor(slots, torch.int64),
                          cu_seqlens_q=cu_seqlens_q, seqlens_k=seqlens_k_t, block_tables=block_tables,
                          logits_indices=tensor(logits_rows, torch.int64),
                          attention_plan=self._attention_plan(*host) if self.use_attention_plan else None)
        return tensor(ids, torch.int64), ctx

    def _attention_plan(self, cu_seqlens_q: torch.Tensor, seqlens_k: torch.Tensor,
                        block_tables: torch.Tensor) -> ops.AttentionPlan:
        """Plan this step from the host-side index arrays, refilling the previous plan's
        buffers in place while the step fits them."""
        batch, tokens = seqlens_k.shape[0], int(cu_seqlens_q[-1])
        if self._plan is not None and (batch > self._plan.max_batch or tokens > self._plan.max_tokens):
            self._plan = None
        self._plan_size = (max(batch, self._plan_size[0]), max(tokens, self._plan_size[1]))
        attn = next(iter(self.model.layers.values())).self_attn
        self._plan = ops.plan_attention(cu_seqlens_q, seqlens_k, block_tables, attn.k_cache, attn.num_heads,
                                        plan=self._plan, max_batch=self._plan_size[0], max_tokens=self._plan_size[1])
        return self._plan
