"""The hybrid-attention plan: built once per step, read by every layer's attention.

`plan_attention` turns one step's batch (cu_seqlens_q, seqlens_k, block tables) into the
work list of an attention kernel: prefill tiles, decode tiles and split-KV pieces with
the merges that combine them, balanced so that no worker (a CTA of the CUDA kernel, a
share of the CPU threads) carries much more than its share. One planner serves both
kernels; `kernel` says which one will run the plan (default: the device's). The work list
has a capacity fixed at construction (from max_batch and max_tokens), so its device
address never changes; the CUDA kernel's partial-result pool is sized from the plans
(see AttentionPlan). To capture a planned step in a CUDA graph, call
`plan.reserve_partials()` once before capturing and `plan.update(...)` before each replay,
outside the graph.

A sliding window (`window=W`: each query sees its own key and the W - 1 before it) is a
property of a plan: its tiles start at the window, so a decode with a 4096-key window
over a 100k-key context reads 4096 keys (rounded out to whole 64-key chunks), not 100k. A
model whose layers use different windows (Gemma's local and global layers) plans once per
window.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from sarathi_rt import _C
from sarathi_rt.utils.dtypes import DTypeLike, parse_dtype
from sarathi_rt.ops._checks import DTYPE_CODES, check_tensor

LAYOUT: dict[str, int] = dict(_C.ATTENTION_PLAN_LAYOUT)
# Grid of an H100/H200-class GPU (132 SMs x 2 CTAs): the default for CUDA-kernel plans
# made on a CPU device, which show what a GPU would run.
DEFAULT_GPU_CTAS = 264
KERNELS = {"cuda": LAYOUT["kernel_cuda"], "cpu": LAYOUT["kernel_cpu"]}
ITEM_FIELDS = ("request", "kv_head", "num_heads", "q_token0", "causal_offset", "row_begin", "num_rows", "kv_begin", "kv_end",
               "kind", "partial")
MERGE_FIELDS = ("q_token0", "kv_head", "num_heads", "row_begin", "num_rows", "first_partial", "num_partials")
NARROW, WIDE = 0, 1


@dataclass(frozen=True)
class PlanCapacity:
    max_items: int
    max_merges: int
    max_partial_rows: int
    num_ctas: int
    kernel: int
    total_words: int

    def as_list(self) -> list[int]:
        return [self.max_items, self.max_merges, self.max_partial_rows, self.num_ctas, self.kernel]


# Contexts are int32, so a window this long already holds every key: full attention.
_FULL_WINDOW = 2 ** 31 - 1


def check_window(window: object) -> int:
    """The kernels' form of a sliding window: None or 0 = full attention (0), else a
    positive int (a window longer than the context is full attention too). Anything else
    is a ValueError naming `window`."""
    if window is None:
        return 0
    if isinstance(window, bool) or not isinstance(window, int):
        raise ValueError(f"window must be None or an int >= 0 (0 = full attention), got {window!r}")
    if window < 0:
        raise ValueError(f"window must be None or an int >= 0 (0 = full attention), got {window}")
    return 0 if window >= _FULL_WINDOW else window


def check_softcap(softcap: object) -> float:
    """The kernels' form of a logit soft cap: None = off (0.0), else a finite number > 0."""
    if softcap is None:
        return 0.0
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not math.isfinite(softcap) \
            or softcap <= 0:
        raise ValueError(f"softcap must be None or a finite number > 0, got {softcap!r}")
    return float(softcap)


def _positive(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")
    return value


class AttentionPlan:
    """Fixed-capacity work list of a hybrid-attention kernel for one step at a time.

    kernel: "cuda" or "cpu", the kernel that runs the plan (default: the device's type; a
    "cuda" plan on a CPU device only shows what a GPU would run). num_ctas: the workers
    the plan balances: the CUDA kernel's persistent CTAs (default: what fits the GPU, or
    264 on a CPU device), or for the CPU kernel 2 per thread (its threads take items
    dynamically; the workers size the splits). window: the sliding window every call
    running this plan uses (None or 0 = full attention; see the module's docstring)."""

    def __init__(self, *, max_batch: int, max_tokens: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
                 device: torch.device | str = "cuda", dtype: DTypeLike = torch.bfloat16,
                 num_ctas: int | None = None, kernel: str | None = None, window: int | None = None) -> None:
        self.window = check_window(window)
        self.max_batch = _positive("max_batch", max_batch)
        self.max_tokens = _positive("max_tokens", max_tokens)
        self.num_q_heads = _positive("num_q_heads", num_q_heads)
        self.num_kv_heads = _positive("num_kv_heads", num_kv_heads)
        self.head_dim = _positive("head_dim", head_dim)
        if num_q_heads % num_kv_heads != 0:
            raise ValueError(f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        dtype = parse_dtype(dtype)
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.kernel = self.device.type if kernel is None else kernel
        if self.kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {sorted(KERNELS)}, got {self.kernel!r}")
        if self.kernel == "cpu" and self.device.type != "cpu":
            raise ValueError(f"kernel='cpu' plans live on the CPU, not on device {self.device}")
        self.dtype = dtype
        if num_ctas is None:
            num_ctas = self._default_ctas()
        cap = _C.attention_plan_capacity(max_batch, max_tokens, num_q_heads, num_kv_heads,
                                         _positive("num_ctas", num_ctas), KERNELS[self.kernel])
        self.capacity = PlanCapacity(*cap)
        on_cuda = self.device.type == "cuda"
        self._host = torch.zeros(self.capacity.total_words, dtype=torch.int32, pin_memory=on_cuda)
        self.buffer = torch.zeros_like(self._host, device=self.device) if on_cuda else self._host
        # Split pieces of the CUDA kernel wait here for their merge: partial_out and
        # partial_lse, one row per query row of a piece. The pool is sized from the plans,
        # not from the capacity's worst case (max_partial_rows, 512 rows per CTA: 69 MB at
        # 264 CTAs and head_dim 128, while most batches split nothing or a few tiles):
        # update() grows it to the rows its plan uses and never shrinks it, so it holds what
        # the largest batch so far needed. Grow-only rather than a fresh tensor per step:
        # no allocation on the step's path, and addresses that move only when a batch needs
        # more rows than any before. A CUDA graph bakes addresses in, so a caller that
        # captures one calls reserve_partials() first (the pool then holds the worst case and
        # never moves); the engine runs its steps eagerly (ModelRunner captures no graph),
        # so its pool follows the batches. The CPU kernel allocates each plan's rows per call.
        self.partial_out = torch.empty(0, head_dim, dtype=torch.float32, device=self.device)
        self.partial_lse = torch.empty(0, dtype=torch.float32, device=self.device)
        # The pinned host buffer may not be rewritten while its last copy is in flight.
        self._copied = torch.cuda.Event() if on_cuda else None
        self.batch = -1  # geometry of the last update; -1 until the first one
        self.total_q = -1
        self.max_blocks_per_seq = -1
        self.cache_shape: tuple[int, ...] = ()

    def _default_ctas(self) -> int:
        if self.kernel == "cpu":
            return _C.cpu_attention_workers()
        if self.device.type != "cuda":
            return DEFAULT_GPU_CTAS
        sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        per_sm = _C.attention_ctas_per_sm(self.head_dim, DTYPE_CODES[self.dtype], self.device.index)
        return sms * per_sm

    def update(self, cu_seqlens_q: torch.Tensor, seqlens_k: torch.Tensor, block_tables: torch.Tensor,
               k_cache: torch.Tensor) -> AttentionPlan:
        """Plans one step (validating every index on host copies) and, on CUDA, copies the
        work list to the device on that device's current stream. Returns self."""
        check_tensor("k_cache", k_cache, ndim=4)
        if k_cache.device != self.device:
            raise ValueError(f"k_cache is on {k_cache.device} but the plan is on {self.device}")
        if tuple(k_cache.shape[2:]) != (self.num_kv_heads, self.head_dim):
            raise ValueError(f"k_cache holds {k_cache.shape[2]} heads of dim {k_cache.shape[3]} but the plan was "
                             f"made for {self.num_kv_heads} heads of dim {self.head_dim}")
        host = {}
        for name, t, ndim in (("cu_seqlens_q", cu_seqlens_q, 1), ("seqlens_k", seqlens_k, 1),
                              ("block_tables", block_tables, 2)):
            check_tensor(name, t, ndim=ndim, dtypes=(torch.int32,))
            host[name] = t.to("cpu").contiguous()
        batch = seqlens_k.shape[0]
        if cu_seqlens_q.shape[0] != batch + 1:
            raise ValueError(f"cu_seqlens_q must have batch + 1 = {batch + 1} entries, got {cu_seqlens_q.shape[0]}")
        if block_tables.shape[0] != batch:
            raise ValueError(f"block_tables must have {batch} rows (one per request), got {block_tables.shape[0]}")
        return self.update_host(host["cu_seqlens_q"], host["seqlens_k"], host["block_tables"],
                                int(host["cu_seqlens_q"][-1]), tuple(k_cache.shape))

    def update_host(self, cu_seqlens_q: torch.Tensor, seqlens_k: torch.Tensor, block_tables: torch.Tensor,
                    total_q: int, cache_shape: tuple[int, ...]) -> AttentionPlan:
        """`update` for a caller that built the step's host arrays itself (the
        ModelRunner, once per step): contiguous int32 CPU tensors of one batch,
        cu_seqlens_q[-1] == total_q, cache_shape the k_cache's, none of which is checked
        again here. The planner still validates every index against the cache. Returns self."""
        batch = seqlens_k.shape[0]
        if batch > self.max_batch:
            raise ValueError(f"batch of {batch} requests exceeds the plan's max_batch={self.max_batch}")
        if total_q > self.max_tokens:
            raise ValueError(f"cu_seqlens_q[-1] = {total_q} tokens exceeds the plan's max_tokens={self.max_tokens}")
        if self._copied is not None:
            self._copied.synchronize()
        partial_rows = _C.build_attention_plan(
            self._host.data_ptr(), cu_seqlens_q.data_ptr(), seqlens_k.data_ptr(), block_tables.data_ptr(), batch,
            total_q, self.num_q_heads, block_tables.shape[1], cache_shape, self.capacity.as_list(), self.window)
        if self.kernel == "cuda":
            self._grow_partials(partial_rows)
        if self._copied is not None:
            # The copy runs on the plan's device's current stream (whichever device is
            # current), so that is where its end is recorded.
            self.buffer.copy_(self._host, non_blocking=True)
            self._copied.record(torch.cuda.current_stream(self.device))
        self.batch, self.total_q = batch, total_q
        self.max_blocks_per_seq = block_tables.shape[1]
        self.cache_shape = cache_shape
        return self

    def reserve_partials(self) -> AttentionPlan:
        """Grows the CUDA kernel's partial-result pool to the capacity's worst case
        (max_partial_rows), so that no later update() moves it: call it before capturing a
        planned step in a CUDA graph. CPU-kernel plans hold no pool. Returns self."""
        if self.kernel == "cuda":
            self._grow_partials(self.capacity.max_partial_rows)
        return self

    def _grow_partials(self, rows: int) -> None:
        # The previous pool goes back to the caching allocator, which hands it out again only
        # after the work already queued on this stream (the plan's stream) has used it.
        if rows > self.partial_out.shape[0]:
            self.partial_out = torch.empty(rows, self.head_dim, dtype=torch.float32, device=self.device)
            self.partial_lse = torch.empty(rows, dtype=torch.float32, device=self.device)

    def check_matches(self, q: torch.Tensor, k_cache: torch.Tensor, seqlens_k: torch.Tensor,
                      block_tables: torch.Tensor, window: int = 0) -> None:
        """Raises ValueError (naming `plan`) unless this plan was built for this call."""
        if self.batch < 0:
            raise ValueError("plan has not been updated with a batch yet (call plan.update)")
        want = {"device": (self.device, q.device), "kernel": (self.kernel, q.device.type),
                "num_q_heads": (self.num_q_heads, q.shape[1]),
                "k_cache shape": (self.cache_shape, tuple(k_cache.shape)),
                "batch": (self.batch, seqlens_k.shape[0]), "total_q": (self.total_q, q.shape[0]),
                "block_tables columns": (self.max_blocks_per_seq, block_tables.shape[1]),
                "window": (self.window, window)}
        for what, (planned, got) in want.items():
            if planned != got:
                raise ValueError(f"plan was built for {what} {planned} but this call has {got}")

    # Views of the host copy of the last plan, for tests and inspection.
    def _section(self, offset: int, count: int, words: int) -> torch.Tensor:
        return self._host[offset:offset + count * words].view(count, words)

    @property
    def num_items(self) -> int:
        return int(self._host[0])

    @property
    def num_merges(self) -> int:
        return int(self._host[1])

    @property
    def partial_rows(self) -> int:
        return int(self._host[2])

    def stats(self) -> dict[str, float]:
        """The last plan under the planner's cost model: num_items, num_splits (tiles cut
        into key ranges), num_partials (their pieces), num_workers, max_load / mean_load
        (cost of the costliest / an average worker), load_efficiency = mean_load / max_load
        (low for a batch too small to fill the workers: that is the truth, not a bug), and
        the partial-result memory in the kernel's layout: partial_rows and partial_bytes
        this batch uses (CUDA: head_dim + 1 float32 per row), partial_pool_bytes the plan
        holds now (CUDA: the largest batch so far, or partial_max_bytes after
        reserve_partials(); 0 on the CPU, whose kernel allocates partial_bytes per call),
        and partial_max_bytes, the most any batch within the capacity may use."""
        if self.batch < 0:
            raise ValueError("plan has not been updated with a batch yet (call plan.update)")
        s = _C.attention_plan_stats(self._host.data_ptr(), self.capacity.as_list(), self.head_dim)
        mean = s["total_load"] / self.capacity.num_ctas
        pool_bytes = 4 * (self.partial_out.numel() + self.partial_lse.numel())
        return {"num_items": s["num_items"], "num_splits": s["num_splits"], "num_partials": s["num_partials"],
                "num_workers": self.capacity.num_ctas, "max_load": s["max_load"], "mean_load": mean,
                "load_efficiency": mean / s["max_load"] if s["max_load"] else 1.0,
                "partial_rows": s["partial_rows"], "partial_bytes": s["partial_bytes"],
                "partial_pool_bytes": pool_bytes,
                "partial_max_bytes": _C.attention_partial_bytes(self.capacity.kernel, self.head_dim,
                                                                self.capacity.max_partial_rows)}

    def work_items(self) -> torch.Tensor:
        """[num_items, len(ITEM_FIELDS)] int32, grouped by CTA in launch order."""
        offset = LAYOUT["header_words"] + self.capacity.num_ctas + 1
        return self._section(offset, self.num_items, LAYOUT["item_words"])

    def merges(self) -> torch.Tensor:
        offset = LAYOUT["header_words"] + self.capacity.num_ctas + 1 + self.capacity.max_items * LAYOUT["item_words"]
        return self._section(offset, self.num_merges, LAYOUT["merge_words"])

    def cta_ranges(self) -> torch.Tensor:
        """[num_ctas + 1]: CTA c runs work_items()[r[c]:r[c + 1]]."""
        start = LAYOUT["header_words"]
        return self._host[start:start + self.capacity.num_ctas + 1]


def plan_attention(cu_seqlens_q: torch.Tensor, seqlens_k: torch.Tensor, block_tables: torch.Tensor,
                   k_cache: torch.Tensor, num_q_heads: int, *, plan: AttentionPlan | None = None,
                   max_batch: int | None = None, max_tokens: int | None = None,
                   num_ctas: int | None = None, kernel: str | None = None,
                   window: int | None = None) -> AttentionPlan:
    """Plans one step of `hybrid_attention`, on CUDA and CPU caches alike. Pass `plan=` to
    refill an existing plan in place (its buffers keep their addresses; it must have been
    made for this `window`); otherwise a new one is sized from max_batch / max_tokens
    (default: this batch), for `kernel` (default: the cache's device type), num_ctas
    workers and the sliding `window` (None or 0 = full attention; see AttentionPlan)."""
    check_tensor("k_cache", k_cache, ndim=4)
    if plan is None:
        check_tensor("seqlens_k", seqlens_k, ndim=1)
        check_tensor("cu_seqlens_q", cu_seqlens_q, ndim=1)
        total_q = int(cu_seqlens_q[-1]) if cu_seqlens_q.numel() else 0
        plan = AttentionPlan(max_batch=max_batch or max(1, seqlens_k.shape[0]),
                             max_tokens=max_tokens or max(1, total_q), num_q_heads=num_q_heads,
                             num_kv_heads=k_cache.shape[2], head_dim=k_cache.shape[3], device=k_cache.device,
                             dtype=k_cache.dtype, num_ctas=num_ctas, kernel=kernel, window=window)
    elif not isinstance(plan, AttentionPlan):
        raise TypeError(f"plan must be an AttentionPlan, got {type(plan).__name__}")
    elif plan.num_q_heads != num_q_heads:
        raise ValueError(f"plan was made for {plan.num_q_heads} query heads, not num_q_heads={num_q_heads}")
    elif kernel is not None and kernel != plan.kernel:
        raise ValueError(f"plan was made for the {plan.kernel} kernel, not kernel={kernel!r}")
    elif plan.window != check_window(window):
        raise ValueError(f"plan was made for window {plan.window}, not window={window!r} (0 = full attention)")
    return plan.update(cu_seqlens_q, seqlens_k, block_tables, k_cache)
