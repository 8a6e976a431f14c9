"""Property test of the attention planner on random batches: every CUDA-grid plan of a
batch with enough work is balanced, and the CPU kernel runs random plans exactly.

The distribution (seeded; bench/bench_attention_plan.py prints its figures):
- Half the batches are decode-only: 1..1024 requests (log-uniform), each context drawn
  around a batch-wide scale (log-uniform over 16..32k) times a log-normal factor
  (sigma 0.7), clipped to 16..128k; 1% of requests are huge outliers, uniform in 64k..128k.
- Half are mixed: 1..4 prefill chunks of 16..4096 tokens (log-uniform) whose prefix is
  empty (30%) or log-uniform up to 64k, plus 0..512 decodes drawn as above; shuffled.
- Head layouts (query heads, KV heads, head_dim): MHA 32/32/128 and 16/16/64, GQA 4 with
  32/8/128 and 16/4/64, GQA 8 with 64/8/128 and 32/4/64.
- Grids of 132, 264 and 528 CTAs (H100/H200: 132 SMs x 1, 2 or 4 CTAs), one per batch.
Target: among batches with at least 4096 key-head pairs per CTA (sum of contexts x KV
heads / CTAs), load efficiency under the planner's cost model >= 0.90 at the 5th
percentile and >= 0.80 for every batch.
"""
from __future__ import annotations

import math
import random

import torch

from sarathi_rt import ops

from attention_batches import assert_strictly_close, make_batch

LAYOUTS = [(32, 32, 128), (16, 16, 64), (32, 8, 128), (16, 4, 64), (64, 8, 128), (32, 4, 64)]
CTAS = (132, 264, 528)
NUM_BATCHES = 500
MIN_PAIRS_PER_CTA = 4096
BLOCK = 1024  # the planner reads block tables only through validation: large pages keep them small


def _decode_context(rng: random.Random, scale: float) -> int:
    if rng.random() < 0.01:
        return rng.randint(65536, 131072)
    return max(16, min(131072, int(scale * math.exp(rng.gauss(0.0, 0.7)))))


def _log_uniform(rng: random.Random, low: float, high: float) -> float:
    return math.exp(rng.uniform(math.log(low), math.log(high)))


def random_batch(rng: random.Random) -> tuple[list[tuple[int, int]], tuple[int, int, int], int]:
    """(q_len, kv_len) per request, the head layout and the CTA count of one batch."""
    scale = _log_uniform(rng, 16, 32768)
    if rng.random() < 0.5:
        lengths = [(1, _decode_context(rng, scale)) for _ in range(int(_log_uniform(rng, 1, 1025)))]
    else:
        lengths = []
        for _ in range(rng.randint(1, 4)):
            q = int(_log_uniform(rng, 16, 4097))
            prefix = 0 if rng.random() < 0.3 else int(_log_uniform(rng, 1, 65536))
            lengths.append((q, prefix + q))
        lengths += [(1, _decode_context(rng, scale)) for _ in range(rng.randint(0, 512))]
        rng.shuffle(lengths)
    return lengths, rng.choice(LAYOUTS), rng.choice(CTAS)


def index_tensors(lengths: list[tuple[int, int]], num_kv_heads: int, head_dim: int):
    """cu_seqlens_q, seqlens_k, block tables and an unfilled cache: the planner reads no
    keys, so every request may share the same pages."""
    pages = -(-max(kv for _, kv in lengths) // BLOCK)
    tables = torch.arange(pages, dtype=torch.int32).expand(len(lengths), -1).contiguous()
    cu = torch.tensor([0] + [q for q, _ in lengths]).cumsum(0).to(torch.int32)
    seqlens = torch.tensor([kv for _, kv in lengths], dtype=torch.int32)
    return cu, seqlens, tables, torch.empty(pages, BLOCK, num_kv_heads, head_dim, dtype=torch.bfloat16)


def plan_efficiencies(seed: int, count: int) -> list[tuple[float, int, dict]]:
    """(load efficiency, CTAs, stats) of every batch with enough work per CTA."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        lengths, (q_heads, kv_heads, head_dim), ctas = random_batch(rng)
        pairs = sum(kv for _, kv in lengths) * kv_heads
        if pairs < MIN_PAIRS_PER_CTA * ctas:
            continue
        plan = ops.plan_attention(*index_tensors(lengths, kv_heads, head_dim), q_heads, num_ctas=ctas, kernel="cuda")
        stats = plan.stats()
        assert stats["partial_rows"] <= plan.capacity.max_partial_rows
        out.append((stats["load_efficiency"], ctas, stats))
    return out


def test_random_batches_fill_the_cta_grid() -> None:
    effs = sorted(e for e, _, _ in plan_efficiencies(seed=0, count=NUM_BATCHES))
    assert len(effs) >= 150, "too few batches with enough work: the distribution changed"
    assert effs[0] >= 0.80, effs[:5]
    assert effs[len(effs) // 20] >= 0.90, effs[:len(effs) // 20 + 1]


def test_the_cpu_kernel_runs_random_plans_exactly() -> None:
    """Small random batches (same shapes of distribution, contexts scaled down) through the
    CPU kernel with plans for 1..64 workers, against the float64 reference."""
    rng = random.Random(1)
    for _ in range(4):
        lengths, (q_heads, kv_heads, _), _ = random_batch(rng)
        lengths = [(min(q, 64), min(q, 64) + min(kv - q, 3000) // 8) for q, kv in lengths[:12]]
        batch = make_batch(lengths, num_kv_heads=kv_heads // 4 or 1, group=q_heads // kv_heads, head_dim=16,
                           block_size=16, dtype=torch.bfloat16, seed=rng.randrange(1000))
        plan = ops.plan_attention(batch.cu_seqlens_q, batch.seqlens_k, batch.block_tables, batch.k_cache,
                                  batch.q.shape[1], num_ctas=rng.choice((1, 3, 8, 64)), kernel="cpu")
        assert_strictly_close(batch.run(plan=plan), batch)
