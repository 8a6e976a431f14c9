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

Then pure decodes at real model shapes (SmolLM2-135M: 9 q heads, 3 KV heads, head_dim 64;
the `tiny` preset: 4, 2, 16), batch 1, 8 and 64, 300 and 2000 tokens of context, one plan
per step as the engine builds it: per call, the KV bytes read and GB/s against a streaming copy (read + write bytes, as
bench_roofline_cpu measures the memory bound) and a streaming read, both measured in the
same run. Each call reads another layer's cache (a step runs every layer once) and the
layers together span at least --working-set-mib, so the keys come from memory, not from
a cache that the previous call warmed.

    python bench/bench_attention.py [--iters 20] [--dtype float32] [--device cpu]
    python bench/bench_attention.py --decode-only --baseline OLD/python [--pairs 5]

With --baseline (another checkout's python/ directory, built in place) only the decode
grid runs, in `pairs` pairs of fresh processes alternating which goes first, and each
shape prints both medians and the median of the pairs' ratios (this VM's speed drifts by
up to 2x within minutes; only a comparison in the same minutes means anything).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from typing import Callable

import torch

from sarathi_rt import ops
from ab_pairs import run_pairs, this_package
from sarathi_rt.ops import reference
from sarathi_rt.ops.attention import run_attention

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# name: (q heads, KV heads, head_dim)
MODEL_SHAPES = {"smollm2": (9, 3, 64), "tiny": (4, 2, 16)}
DECODE_BATCHES = (1, 8, 64)
DECODE_CONTEXTS = (300, 2000)
MAX_LAYERS = 4096  # bounds the calls per timed step where one layer's cache is tiny


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


def copy_gbs(nbytes: int, args: argparse.Namespace) -> float:
    """GB/s of a streaming copy of nbytes (read + write bytes): the memory bound
    bench_roofline_cpu uses."""
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=args.device)
    dst = torch.empty_like(src)
    return 2 * nbytes / median_ms(lambda: dst.copy_(src), args.iters, args.warmup, args.device) / 1e6


def decode_case(shape: str, batch: int, context: int, args: argparse.Namespace,
                dtype: torch.dtype) -> dict[str, float]:
    """ms per planned decode call at a model's shape, each call on another layer's cache
    (the same block table, as in the engine), with the pages in random order. The calls
    go through run_attention, as the model's layers make them: the inputs were checked
    once, by the first call through hybrid_attention."""
    q_heads, kv_heads, head_dim = MODEL_SHAPES[shape]
    g = torch.Generator().manual_seed(args.seed)
    pages = math.ceil(context / args.block_size)
    layer_bytes = 2 * batch * pages * args.block_size * kv_heads * head_dim * dtype.itemsize
    layers = min(MAX_LAYERS, max(1, math.ceil((args.working_set_mib << 20) / layer_bytes)))
    one = torch.randn(batch * pages, args.block_size, kv_heads, head_dim, generator=g).to(dtype)
    k = one.expand(layers, *one.shape).contiguous()
    v = (-one).expand(layers, *one.shape).contiguous()
    block_tables = torch.randperm(batch * pages, generator=g).to(torch.int32).view(batch, pages)
    q = torch.randn(batch, q_heads, head_dim, generator=g).to(dtype)
    cu_seqlens_q = torch.arange(batch + 1, dtype=torch.int32)
    seqlens_k = torch.full((batch,), context, dtype=torch.int32)
    plan = ops.plan_attention(cu_seqlens_q, seqlens_k, block_tables, k[0], q_heads)
    out = torch.empty_like(q)
    ops.hybrid_attention(q, k[0], v[0], cu_seqlens_q, seqlens_k, block_tables, out=out, plan=plan)
    scale = head_dim ** -0.5

    def step() -> None:
        for layer in range(layers):
            run_attention(plan, q, k[layer], v[layer], cu_seqlens_q, seqlens_k, block_tables, scale, out)

    ms = median_ms(step, args.iters, args.warmup, args.device) / layers
    kv_bytes = 2 * batch * context * kv_heads * head_dim * dtype.itemsize
    return {"ms": ms, "kv_bytes": kv_bytes, "layers": layers}


def decode_grid(args: argparse.Namespace, dtype: torch.dtype) -> dict[str, object]:
    """Every case of the grid, and the copy and read bandwidths measured just before."""
    nbytes = args.working_set_mib << 20
    result: dict[str, object] = {"copy_gbs": copy_gbs(nbytes, args), "read_gbs": streaming_read_gbs(nbytes, args)}
    cases = {}
    for shape in args.shapes:
        for batch in args.batches:
            for context in args.contexts:
                cases[f"{shape} B={batch} ctx={context}"] = decode_case(shape, batch, context, args, dtype)
    result["cases"] = cases
    return result


def print_grid(grid: dict[str, object]) -> None:
    copy, read = grid["copy_gbs"], grid["read_gbs"]
    print(f"decode KV read per call vs streaming copy {copy:.2f} GB/s (read + write) and read {read:.2f} GB/s:")
    for name, c in grid["cases"].items():
        gbs = c["kv_bytes"] / c["ms"] / 1e6
        print(f"  {name:<22} {c['ms']:9.4f} ms  KV {c['kv_bytes'] / 1e6:8.3f} MB  {gbs:6.2f} GB/s  "
              f"{gbs / copy:5.0%} of copy  {gbs / read:5.0%} of read  ({c['layers']} layers)")


def compare_builds(args: argparse.Namespace) -> None:
    """The decode grid in pairs of fresh processes, the baseline's package against this
    one's, alternating which goes first; each child prints decode_grid() as JSON."""
    here = this_package()
    child_args = ["--decode-only", "--json", "--dtype", args.dtype, "--iters", str(args.iters), "--warmup",
                  str(args.warmup), "--working-set-mib", str(args.working_set_mib), "--shapes", *args.shapes,
                  "--batches", *map(str, args.batches), "--contexts", *map(str, args.contexts)]
    load_before = os.getloadavg()
    runs = run_pairs(__file__, child_args, args.baseline, args.pairs)
    copy = statistics.median(r["copy_gbs"] for r in runs["baseline"] + runs["this"])
    print(f"{args.pairs} pairs of processes, {args.dtype}, torch threads {torch.get_num_threads()}; "
          f"baseline {args.baseline}, this {here}; streaming copy median {copy:.2f} GB/s")
    print(f"  {'case':<22} {'baseline ms':>11} {'this ms':>9} {'this/base':>9} (pairs)      "
          f"{'base GB/s':>9} {'this GB/s':>9} {'of copy':>7}")
    for name in runs["this"][0]["cases"]:
        base = [r["cases"][name]["ms"] for r in runs["baseline"]]
        this = [r["cases"][name]["ms"] for r in runs["this"]]
        ratios = [t / b for t, b in zip(this, base)]
        kv_bytes = runs["this"][0]["cases"][name]["kv_bytes"]
        b_gbs, t_gbs = kv_bytes / statistics.median(base) / 1e6, kv_bytes / statistics.median(this) / 1e6
        print(f"  {name:<22} {statistics.median(base):11.4f} {statistics.median(this):9.4f} "
              f"{statistics.median(ratios):8.2f}x ({min(ratios):.2f}-{max(ratios):.2f}x) "
              f"{b_gbs:9.2f} {t_gbs:9.2f} {t_gbs / copy:7.0%}")
    print(f"load (1/5/15 min): before {' '.join(f'{x:.2f}' for x in load_before)}, "
          f"after {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


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
    parser.add_argument("--shapes", nargs="+", choices=sorted(MODEL_SHAPES), default=list(MODEL_SHAPES))
    parser.add_argument("--batches", nargs="+", type=int, default=list(DECODE_BATCHES))
    parser.add_argument("--contexts", nargs="+", type=int, default=list(DECODE_CONTEXTS))
    parser.add_argument("--working-set-mib", type=int, default=256,
                        help="the decode grid's layers span at least this much KV, far past the caches")
    parser.add_argument("--decode-only", action="store_true", help="only the decode grid")
    parser.add_argument("--baseline", default=None, help="another checkout's python/ directory to compare with")
    parser.add_argument("--pairs", type=int, default=5, help="with --baseline: pairs of processes")
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--smoke", action="store_true", help="a seconds-long run of the same code path (quick lane)")
    args = parser.parse_args()
    if args.smoke:
        args.iters, args.warmup, args.q_heads, args.kv_heads, args.head_dim = 1, 1, 4, 2, 64
        args.shapes, args.batches, args.contexts, args.working_set_mib, args.pairs = ["tiny"], [8], [300], 4, 1
    dtype = DTYPES[args.dtype]
    if args.baseline is not None:
        if not os.path.isdir(os.path.join(args.baseline, "sarathi_rt")):
            raise SystemExit(f"--baseline must be a directory holding the sarathi_rt package, got {args.baseline!r}")
        compare_builds(args)
        return
    if args.decode_only:
        grid = decode_grid(args, dtype)
        if args.json:
            print(json.dumps(grid))
        else:
            print_grid(grid)
        return

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
    print_grid(decode_grid(args, dtype))


if __name__ == "__main__":
    main()
