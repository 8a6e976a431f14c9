"""hybrid_attention vs what a user would write without us, in the same run.

The batch is one Sarathi-Serve step: 32 decodes with 512-2048 tokens of context plus one
512-token prefill chunk over a 1024-token prefix (32 query heads, 8 KV heads, head_dim
128, block 16). The baseline gathers each request's keys and values from its pages and
calls torch.nn.functional.scaled_dot_product_attention per request, with the
bottom-right causal mask for the chunk. Prints medians after warm-up, the ratio, and
decode-only achieved GB/s (KV bytes read / time) against what this machine's memory
delivers to a plain streaming read of the same number of bytes (torch.sum over a float32
tensor, on torch's threads) in the same run: decode attention is memory-bound, so that
fraction says how much is left to gain.

    python bench/bench_attention.py [--iters 20] [--dtype float32] [--device cpu]
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch

from sarathi_rt import ops
from sarathi_rt.ops import reference

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def build_batch(q_lens: list[int], kv_lens: list[int], args: argparse.Namespace,
                dtype: torch.dtype) -> reference.PagedBatch:
    return reference.random_paged_batch(list(zip(q_lens, kv_lens)), num_q_heads=args.q_heads,
                                        num_kv_heads=args.kv_heads, head_dim=args.head_dim,
                                        block_size=args.block_size, dtype=dtype, device=args.device, seed=args.seed)


def median_ms(fn: Callable[[], None], iters: int, warmup: int, device: str) -> float:
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def streaming_read_gbs(nbytes: int, args: argparse.Namespace) -> float:
    """GB/s of torch.sum over nbytes of float32: the memory-bandwidth ceiling for decodes."""
    data = torch.ones(nbytes // 4, dtype=torch.float32, device=args.device)
    return nbytes / median_ms(lambda: data.sum(), args.iters, args.warmup, args.device) / 1e6


def compare(name: str, batch: reference.PagedBatch, args: argparse.Namespace) -> tuple[float, float]:
    out_ours, out_base = torch.empty_like(batch.q), torch.empty_like(batch.q)

    def ours() -> None:
        ops.hybrid_attention(*batch.args(), out=out_ours)

    def baseline() -> None:
        reference.sdpa_per_request(*batch.args(), out=out_base)

    ours()
    baseline()
    diff = (out_ours.double() - out_base.double()).abs().max().item()
    t_ours = median_ms(ours, args.iters, args.warmup, args.device)
    t_base = median_ms(baseline, args.iters, args.warmup, args.device)
    print(f"{name:<12} hybrid_attention {t_ours:8.3f} ms   gather+SDPA {t_base:8.3f} ms   "
          f"speedup {t_base / t_ours:5.2f}x   max |diff| {diff:.2e}")
    return t_ours, t_base


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--q-heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--smoke", action="store_true", help="a seconds-long run of the same code path (quick lane)")
    args = parser.parse_args()
    if args.smoke:
        args.iters, args.warmup, args.q_heads, args.kv_heads, args.head_dim = 1, 1, 4, 2, 64
    dtype = DTYPES[args.dtype]

    g = torch.Generator().manual_seed(args.seed)
    decode_kv = torch.randint(512, 2049, (32,), generator=g).tolist()
    chunk, prefix = 512, 1024
    print(f"device {args.device}, {args.dtype}, {args.q_heads} q heads / {args.kv_heads} kv heads, head_dim "
          f"{args.head_dim}, block {args.block_size}, torch threads {torch.get_num_threads()}, "
          f"median of {args.iters} after {args.warmup} warm-up")
    mixed = build_batch([1] * 32 + [chunk], decode_kv + [prefix + chunk], args, dtype)
    t_ours, t_base = compare("mixed", mixed, args)
    decodes = build_batch([1] * 32, decode_kv, args, dtype)
    d_ours, d_base = compare("decode-only", decodes, args)

    kv_bytes = 2 * sum(decode_kv) * args.kv_heads * args.head_dim * dtype.itemsize
    stream = streaming_read_gbs(kv_bytes, args)
    ours_gbs = kv_bytes / d_ours / 1e6
    print(f"streaming read (torch.sum, float32, {kv_bytes / 1e6:.1f} MB) {stream:.2f} GB/s")
    print(f"mixed speedup {t_base / t_ours:.2f}x; decode-only KV read {kv_bytes / 1e6:.1f} MB: "
          f"{ours_gbs:.2f} GB/s ours ({ours_gbs / stream:.0%} of streaming read) vs "
          f"{kv_bytes / d_base / 1e6:.2f} GB/s baseline")


if __name__ == "__main__":
    main()
