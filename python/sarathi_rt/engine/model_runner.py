"""StepInput -> the step context: built once per step and read by every layer."""
from __future__ import annotations

import torch

from sarathi_rt import _C, ops
from sarathi_rt.models import CausalLM, StepContext

from sarathi_rt.ops.kv_cache import KVCache
from .step_io import StepInput


class _Staging:
    """Host -> device transfer of a step's index arrays. On CUDA they go through a
    reused pinned buffer (an asynchronous copy, no page-locking per step); the buffer is
    rewritten only after its previous copy has finished."""

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        self.device, self.dtype = device, dtype
        self.cuda = device.type == "cuda"
        self._pinned = torch.empty(0, dtype=dtype)
        self._copied = torch.cuda.Event() if self.cuda else None

    def to_device(self, values: bytearray) -> tuple[torch.Tensor, torch.Tensor]:
        """(host tensor, device tensor) of the native-endian `values` (the tensor shares
        their memory); the same tensor on the CPU."""
        host = torch.frombuffer(values, dtype=self.dtype)
        if not self.cuda:
            return host, host
        assert self._copied is not None
        self._copied.synchronize()
        if self._pinned.numel() < host.numel():
            self._pinned = torch.empty(max(host.numel(), 2 * self._pinned.numel()), dtype=self.dtype,
                                       pin_memory=True)
        pinned = self._pinned[:host.numel()]
        pinned.copy_(host)
        out = pinned.to(self.device, non_blocking=True)
        self._copied.record()
        return host, out


class ModelRunner:
    """Runs steps of `model` over `kv_cache`, the cache it is bound to. `max_batch` /
    `max_tokens` size the attention plan's buffers (a larger step grows them). prepare() validates the step once: positions against the model's
    context, block tables against the positions, token ids against the vocabulary, and
    block ids against the cache while planning attention (for the CPU and the CUDA
    kernel alike); the layers then run on the context without checking it again."""

    def __init__(self, model: CausalLM, kv_cache: KVCache, block_size: int, max_batch: int = 1,
                 max_tokens: int = 1) -> None:
        self.model = model
        self.block_size = block_size
        self.device = model.device
        self.vocab_size = model.config.vocab_size
        self.max_position = model.config.max_position_embeddings
        # One plan per sliding window the layers use (0 = full attention), each refilled per step.
        config = model.config
        self._windows = tuple(dict.fromkeys(config.layer_window(i) for i in range(config.num_hidden_layers)))
        self._plans: dict[int, ops.AttentionPlan] = {}
        self._num_q_heads = model.shard.num_heads
        # Every layer's cache has the same shape: the plan reads the first.
        self._k_cache = kv_cache.layer(0)[0]
        self._plan_size = (max_batch, max_tokens)
        self._int64 = _Staging(self.device, torch.int64)
        self._int32 = _Staging(self.device, torch.int32)

    def prepare(self, step: StepInput) -> tuple[torch.Tensor, StepContext]:
        """Token ids and the per-step context every layer reads. The index arrays come
        from one call into the core (_C.step_indices), which validates every chunk."""
        longs_buffer, ints_buffer, tokens, width = _C.step_indices(step.chunks, self.block_size, self.max_position,
                                                                   self.vocab_size)
        batch = len(step.chunks)
        # One transfer per dtype; the context's tensors are views of it (torch.split: one
        # call for all of them, where slicing pays Python's indexing per view).
        _, longs = self._int64.to_device(longs_buffer)
        host, ints = self._int32.to_device(ints_buffer)
        sizes = [batch + 1, batch, batch * width]
        cu_seqlens_q, seqlens_k, block_tables = torch.split(ints, sizes)
        host_cu, host_seqlens, host_tables = torch.split(host, sizes)
        ids, positions, slots, logits_rows = torch.split(longs, [tokens, tokens, tokens, longs.shape[0] - 3 * tokens])
        plans = [self._attention_plan(host_cu, host_seqlens, host_tables.view(batch, width), tokens, window)
                 for window in self._windows]
        ctx = StepContext(positions=positions, slot_mapping=slots, cu_seqlens_q=cu_seqlens_q, seqlens_k=seqlens_k,
                          block_tables=block_tables.view(batch, width), logits_indices=logits_rows,
                          attention_plan=plans[0], other_plans=tuple(plans[1:]))
        return ids, ctx

    def _attention_plan(self, cu_seqlens_q: torch.Tensor, seqlens_k: torch.Tensor, block_tables: torch.Tensor,
                        tokens: int, window: int) -> ops.AttentionPlan:
        """Plan this step for one window from the host-side index arrays, refilling that
        window's previous plan in place while the step fits it (a larger step gets a larger plan)."""
        batch, k_cache = seqlens_k.shape[0], self._k_cache
        plan = self._plans.get(window)
        if plan is None or batch > plan.max_batch or tokens > plan.max_tokens:
            self._plan_size = (max(batch, self._plan_size[0]), max(tokens, self._plan_size[1]))
            plan = self._plans[window] = ops.AttentionPlan(
                max_batch=self._plan_size[0], max_tokens=self._plan_size[1], num_q_heads=self._num_q_heads,
                num_kv_heads=k_cache.shape[2], head_dim=k_cache.shape[3], device=k_cache.device, dtype=k_cache.dtype,
                window=window)
        return plan.update_host(cu_seqlens_q, seqlens_k, block_tables, tokens, tuple(k_cache.shape))
