"""GPU benchmarks of the fused hybrid attention against torch's own attention, measured
in the same run (medians of CUDA-event timings after warm-up):

1. decode-heavy mixed batch (64 decodes x 4k context + one 512-token chunk; 32 query
   heads, 8 KV heads, head_dim 128, bf16): achieved TB/s vs the HBM peak, and time vs
   F.scaled_dot_product_attention on KV gathered into dense tensors beforehand;
2. prefill chunk (2048 new tokens over 2048 cached): TFLOP/s vs torch's flash SDPA;
3. the fused mixed launch vs separate prefill and decode launches of our kernel;
4. skewed decode batches (one long context among short ones, a count of equal decodes
   that does not fill whole waves, uniform random lengths): achieved HBM GB/s (KV bytes
   read / time) vs the peak, and the plan's load efficiency (mean / max CTA cost).

`--smoke` runs tiny shapes through the same code, on the CPU when there is no GPU (a
smoke test, no claims; the quick test lane runs it).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from sarathi_rt import ops
from sarathi_rt.ops import reference

PEAK_TBPS = 4.8      # H200 HBM3e
PEAK_TFLOPS = 989.0  # H200 dense bf16 tensor cores


@dataclass
class Shape:
    skew_short: int = 512    # 63 decodes at this context plus one at skew_long
    skew_long: int = 32768
    waves: int = 4096        # 40 decodes at this context
    uniform_max: int = 8192  # 256 decodes uniform in 100 .. uniform_max
    decodes: int = 64
    context: int = 4096
    chunk: int = 512
    prefill_q: int = 2048
    prefill_cached: int = 2048
    q_heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16


SMALL = Shape(skew_short=64, skew_long=2048, waves=256, uniform_max=512, decodes=4, context=256, chunk=32,
              prefill_q=64, prefill_cached=64, q_heads=4, kv_heads=2, head_dim=64)


def median_ms(fn: Callable[[], object], device: torch.device, warmup: int = 5, reps: int = 15,
              inner: int = 10) -> float:
    """Median over `reps` samples of the mean time of `inner` back-to-back calls: the
    host runs ahead of the GPU, so Python launch overhead hides behind the kernels."""
    if device.type != "cuda":  # the CPU path is a smoke test: keep it short
        warmup, reps, inner = 1, 3, 1
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(inner):
                fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / inner)
        else:
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            times.append((time.perf_counter() - t0) * 1e3 / inner)
    return statistics.median(times)


@dataclass
class Batch(reference.PagedBatch):
    lengths: list[tuple[int, int]]

    def kv_bytes(self) -> int:
        per_token = 2 * self.k_cache.shape[2] * self.k_cache.shape[3] * self.k_cache.element_size()
        return sum(kv for _, kv in self.lengths) * per_token

    def flops(self) -> int:
        """Q.K^T and P.V over the visible (bottom-right causal) keys only."""
        visible = sum(q * (kv - q) + q * (q + 1) // 2 for q, kv in self.lengths)
        return 4 * self.q.shape[1] * self.q.shape[2] * visible


def make_batch(lengths: list[tuple[int, int]], s: Shape, dtype: torch.dtype, device: torch.device) -> Batch:
    b = reference.random_paged_batch(lengths, num_q_heads=s.q_heads, num_kv_heads=s.kv_heads, head_dim=s.head_dim,
                                     block_size=s.block_size, dtype=dtype, device=device)
    return Batch(*b.args(), lengths)


def dense_kv(b: Batch, request: int, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[1, heads, kv_len, D] keys and values of one request, each KV head repeated `group` times."""
    kv_len = b.lengths[request][1]
    out = []
    for cache in (b.k_cache, b.v_cache):
        kv = reference.gather_kv(cache, b.block_tables[request], kv_len).repeat_interleave(group, dim=1)
        out.append(kv.transpose(0, 1).unsqueeze(0).contiguous())
    return out[0], out[1]


def sdpa_fn(b: Batch, requests: list[int]) -> Callable[[], object]:
    """torch's attention over pre-gathered KV: decodes as one batched call, each chunk
    with a bottom-right causal mask."""
    decodes = [r for r in requests if b.lengths[r][0] == 1]
    chunks = [r for r in requests if b.lengths[r][0] > 1]
    group = b.q.shape[1] // b.k_cache.shape[2]
    dk = [dense_kv(b, r, 1) for r in decodes]  # decodes read unexpanded KV (enable_gqa)
    k_dec = torch.cat([k for k, _ in dk]) if dk else None
    v_dec = torch.cat([v for _, v in dk]) if dk else None
    q_dec = b.q[b.cu_seqlens_q[decodes].long()].unsqueeze(2) if decodes else None  # [n, H, 1, D]
    chunk_args = []
    for r in chunks:
        q0, q1 = int(b.cu_seqlens_q[r]), int(b.cu_seqlens_q[r + 1])
        k, v = dense_kv(b, r, group)
        mask = causal_lower_right(q1 - q0, b.lengths[r][1])
        chunk_args.append((b.q[q0:q1].transpose(0, 1).unsqueeze(0), k, v, mask))

    def run() -> None:
        if q_dec is not None:
            F.scaled_dot_product_attention(q_dec, k_dec, v_dec, enable_gqa=True)
        for q, k, v, mask in chunk_args:
            F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return run


def flash_sdpa_fn(b: Batch) -> tuple[Callable[[], object], str]:
    run = sdpa_fn(b, list(range(len(b.lengths))))
    if b.q.device.type != "cuda":
        return run, "default"
    from torch.nn.attention import SDPBackend, sdpa_kernel
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
        try:
            with sdpa_kernel(backend):
                run()

            def pinned(backend=backend) -> None:
                with sdpa_kernel(backend):
                    run()
            return pinned, backend.name.lower()
        except RuntimeError:
            continue
    return run, "default"


def ours_fn(b: Batch) -> Callable[[], object]:
    plan = ops.plan_attention(b.cu_seqlens_q, b.seqlens_k, b.block_tables, b.k_cache, b.q.shape[1])
    out = torch.empty_like(b.q)
    return lambda: ops.hybrid_attention(*b.args(), out=out, plan=plan)


def skewed_batches(s: Shape) -> dict[str, list[tuple[int, int]]]:
    uniform = torch.randint(100, s.uniform_max + 1, (256,), generator=torch.Generator().manual_seed(0)).tolist()
    return {f"skew 63x{s.skew_short}+1x{s.skew_long}": [(1, s.skew_short)] * 63 + [(1, s.skew_long)],
            f"skew 40x{s.waves}": [(1, s.waves)] * 40,
            f"skew 256xU(100,{s.uniform_max})": [(1, kv) for kv in uniform]}


def skewed_rows(s: Shape, device: torch.device, dtype: torch.dtype) -> list[dict[str, object]]:
    rows = []
    for name, lengths in skewed_batches(s).items():
        b = make_batch(lengths, s, dtype, device)
        plan = ops.plan_attention(b.cu_seqlens_q, b.seqlens_k, b.block_tables, b.k_cache, b.q.shape[1])
        out = torch.empty_like(b.q)
        ms = median_ms(lambda: ops.hybrid_attention(*b.args(), out=out, plan=plan), device)
        gbps = (b.kv_bytes() + 2 * b.q.numel() * b.q.element_size()) / ms / 1e6
        stats = plan.stats()
        rows.append(row(name, "bandwidth", gbps, "GB/s", "HBM peak", 1e3 * PEAK_TBPS, gbps / (1e3 * PEAK_TBPS),
                        ">= 0.70 of peak"))
        rows.append(row(name, "load efficiency", stats["load_efficiency"], "", f"{stats['num_workers']} workers, "
                        f"{stats['num_splits']} splits", 1.0, stats["load_efficiency"], ">= 0.9"))
    return rows


def row(case: str, metric: str, value: float, unit: str, baseline: str, base_value: float, ratio: float,
        target: str) -> dict[str, object]:
    return dict(bench="attention", case=case, metric=metric, value=round(value, 4), unit=unit, baseline=baseline,
                baseline_value=round(base_value, 4), ratio=round(ratio, 3), target=target)


def run(s: Shape, device: torch.device, dtype: torch.dtype) -> list[dict[str, object]]:
    rows = []
    mixed = make_batch([(1, s.context)] * s.decodes + [(s.chunk, s.chunk)], s, dtype, device)
    ours_ms = median_ms(ours_fn(mixed), device)
    torch_ms = median_ms(sdpa_fn(mixed, list(range(len(mixed.lengths)))), device)
    tbps = (mixed.kv_bytes() + 2 * mixed.q.numel() * mixed.q.element_size()) / ours_ms / 1e9
    rows.append(row("decode-heavy mixed", "bandwidth", tbps, "TB/s", "HBM peak", PEAK_TBPS, tbps / PEAK_TBPS,
                    ">= 0.70 of peak"))
    rows.append(row("decode-heavy mixed", "time", ours_ms, "ms", "torch SDPA, gathered KV", torch_ms,
                    torch_ms / ours_ms, "> 1 (speed-up)"))

    prefill = make_batch([(s.prefill_q, s.prefill_q + s.prefill_cached)], s, dtype, device)
    ours_ms = median_ms(ours_fn(prefill), device)
    flash, backend = flash_sdpa_fn(prefill)
    flash_ms = median_ms(flash, device)
    tflops = prefill.flops() / ours_ms / 1e9
    rows.append(row("prefill chunk", "throughput", tflops, "TFLOP/s", f"torch SDPA ({backend})",
                    prefill.flops() / flash_ms / 1e9, flash_ms / ours_ms, ">= 1, then 0.5 of bf16 peak"))
    rows.append(row("prefill chunk", "of bf16 peak", tflops / PEAK_TFLOPS, "", "bf16 peak", PEAK_TFLOPS,
                    tflops / PEAK_TFLOPS, "-> 0.5"))

    decodes = make_batch(mixed.lengths[:-1], s, dtype, device)
    chunk = make_batch(mixed.lengths[-1:], s, dtype, device)
    fused_ms = median_ms(ours_fn(mixed), device)
    dec_fn, chunk_fn = ours_fn(decodes), ours_fn(chunk)
    separate_ms = median_ms(lambda: (dec_fn(), chunk_fn()), device)
    rows.append(row("mixed fused vs separate", "time", fused_ms, "ms", "prefill + decode launches", separate_ms,
                    separate_ms / fused_ms, "> 1 (speed-up)"))
    return rows + skewed_rows(s, device, dtype)


def check_correct(s: Shape, device: torch.device, dtype: torch.dtype) -> float:
    """Max |ours - float64 reference| on a small mixed batch, so a fast wrong kernel shows."""
    b = make_batch([(1, 300), (1, 77), (40, 100)], s, dtype, device)
    got = ops.hybrid_attention(*b.args())
    return (got.double() - reference.hybrid_attention(*b.args())).abs().max().item()


def print_rows(rows: list[dict[str, object]]) -> None:
    for r in rows:
        print(f"{r['case']:<26} {r['metric']:<13} {r['value']:>10} {r['unit']:<8} vs {r['baseline']:<28} "
              f"{r['baseline_value']:>10}  ratio {r['ratio']:>7}  (target {r['target']})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, on the CPU without a GPU (no claims)")
    ap.add_argument("--summary", help="append the rows as JSON lines to this file")
    args = ap.parse_args()
    if args.smoke and not torch.cuda.is_available():
        args.device = "cpu"
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = SMALL if args.smoke else Shape()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (smoke run: no claims)"
    print(f"# hybrid attention on {name}, {str(dtype).removeprefix('torch.')}, {shape}")
    print(f"# max |error| vs float64 reference: {check_correct(shape, device, dtype):.3e}")
    rows = run(shape, device, dtype)
    print_rows(rows)
    if args.summary:
        with open(args.summary, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
