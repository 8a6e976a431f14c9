"""The CPU kernels a decoder layer runs besides its GEMMs, per call at a real model's
shapes, at every ISA level this CPU runs (base, avx2, avx512, avx512_bf16).

The kernels: the fused residual add + rms_norm, rotary (q and k views of one qkv
buffer), write_kv (from that buffer), silu_and_mul, and one planned attention call, at
SmolLM2-135M's shapes (hidden 576, 9 query heads, 3 KV heads, head_dim 64, intermediate
1536) for a decode step (64 tokens; attention: 64 decodes over 300 keys each) and a
prefill chunk (512 tokens; attention: one chunk after a 512-token prefix). Only bf16
attention has avx512_bf16 code of its own (vdpbf16ps scores); the table's last column
is then each kernel's avx512 time over its avx512_bf16 time, measured in the same turns.
The levels take turns (every kernel at base, then at avx2, ..., `rounds` times), so the
ratio of each level to the base level is measured in the same minutes; each figure is
the median over the rounds of the mean us per call over `iters` back-to-back calls
(the ops are called through torch.ops, without the Python checks, as the model's layers
call them).

    python bench/bench_cpu_kernels.py [--dtype bfloat16] [--iters 200] [--rounds 5]
    python bench/bench_cpu_kernels.py --kernels attention --levels avx512 avx512_bf16
    python bench/bench_cpu_kernels.py --baseline OLD/python [--pairs 5]

With --baseline (another checkout's python/ directory, built in place) only the CPU's
own level runs, in `pairs` pairs of fresh processes alternating which goes first, and
each kernel prints both medians and the median of the pairs' ratios (this VM's speed
drifts by up to 2x within minutes; only a comparison in the same minutes means anything).
SARATHI_RT_CPU_ISA caps the levels run (and so picks the level an A/B runs at). --smoke
runs a few calls and checks that every level's outputs agree with the CPU's own
level's within two roundings to the storage dtype.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable

# The native kernels size their OpenMP team when the library loads: give them the
# thread count (--threads, default 1: on a shared machine a team of two waits for
# whichever thread another process delays) before anything imports it.
_threads = sys.argv[sys.argv.index("--threads") + 1] if "--threads" in sys.argv else "1"
os.environ.setdefault("OMP_NUM_THREADS", _threads)

import torch  # noqa: E402

from sarathi_rt import _C, ops  # noqa: E402
from ab_pairs import run_pairs, this_package  # noqa: E402

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
LEVELS = ["base", "avx2", "avx512", "avx512_bf16"]
HIDDEN, Q_HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE = 576, 9, 3, 64, 1536
DECODE_CONTEXT, BLOCK_SIZE = 300, 16
# Two roundings to the storage dtype, relative: how far two levels' outputs may drift
# apart (their sums of squares and dot products add in different orders).
AGREE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
KERNEL_NAMES = ["rms_norm+residual", "rotary", "write_kv", "silu_and_mul", "attention"]
CHUNK_PREFIX = 512  # keys before a prefill chunk's first query


def kernels(tokens: int, dtype: torch.dtype, seed: int) -> dict[str, tuple[Callable[[], None], torch.Tensor]]:
    """name: (one call, the tensor it writes) for `tokens` tokens; the calls are the
    torch.ops the model's layers make, on inputs built once."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=g).to(dtype)
    res = torch.randn(tokens, HIDDEN, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(HIDDEN, generator=g)).to(dtype)
    normed, res_out = torch.empty_like(x), torch.empty_like(x)
    qkv = torch.randn(tokens, Q_HEADS + 2 * KV_HEADS, HEAD_DIM, generator=g).to(dtype)
    q, k, v = qkv[:, :Q_HEADS], qkv[:, Q_HEADS:Q_HEADS + KV_HEADS], qkv[:, Q_HEADS + KV_HEADS:]
    cos_sin = ops.rope_cos_sin_cache(HEAD_DIM, 4096, 10000.0)
    positions = torch.randint(0, 4096, (tokens,), generator=g)
    pages = -(-DECODE_CONTEXT // BLOCK_SIZE)
    blocks = tokens * pages
    k_cache = torch.randn(blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=g).to(dtype)
    v_cache = torch.randn(blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=g).to(dtype)
    slots = torch.randperm(blocks * BLOCK_SIZE, generator=g)[:tokens]
    gate_up = torch.randn(tokens, 2 * INTERMEDIATE, generator=g).to(dtype)
    act = torch.empty(tokens, INTERMEDIATE, dtype=dtype)
    sr = torch.ops.sarathi_rt
    calls: dict[str, tuple[Callable[[], None], torch.Tensor]] = {
        "rms_norm+residual": (lambda: sr.rms_norm_out(x, res, w, 1e-5, normed, res_out), normed),
        # in place: each call rotates the last one's output further (a rotation keeps the norms)
        "rotary": (lambda: sr.rotary_embedding(positions, q, k, cos_sin), qkv),
        "write_kv": (lambda: sr.write_kv(k, v, k_cache, v_cache, slots, False), k_cache),
        "silu_and_mul": (lambda: sr.silu_and_mul_out(gate_up, act), act),
    }
    if tokens <= 64:  # a decode step: one query per request over its pages
        block_tables = torch.randperm(blocks, generator=g).to(torch.int32).view(tokens, pages)
        cu_seqlens_q = torch.arange(tokens + 1, dtype=torch.int32)
        seqlens_k = torch.full((tokens,), DECODE_CONTEXT, dtype=torch.int32)
    else:  # a prefill chunk: one request's tokens after its prefix, on pages of its own
        chunk_pages = -(-(CHUNK_PREFIX + tokens) // BLOCK_SIZE)
        block_tables = torch.randperm(blocks, generator=g)[:chunk_pages].to(torch.int32).view(1, chunk_pages)
        cu_seqlens_q = torch.tensor([0, tokens], dtype=torch.int32)
        seqlens_k = torch.tensor([CHUNK_PREFIX + tokens], dtype=torch.int32)
    plan = ops.plan_attention(cu_seqlens_q, seqlens_k, block_tables, k_cache, Q_HEADS)
    out = torch.empty(tokens, Q_HEADS, HEAD_DIM, dtype=dtype)
    query = torch.randn(tokens, Q_HEADS, HEAD_DIM, generator=g).to(dtype)
    calls["attention"] = (lambda: sr.hybrid_attention_out(query, k_cache, v_cache, cu_seqlens_q, seqlens_k,
                                                          block_tables, plan.buffer, plan.capacity.as_list(),
                                                          HEAD_DIM ** -0.5, out, 0, 0.0), out)
    return calls


def us_per_call(fn: Callable[[], None], iters: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return 1e6 * (time.perf_counter() - start) / iters


def measure(args: argparse.Namespace, levels: list[str]) -> dict[str, dict[str, float]]:
    """{"kernel T=tokens": {level: median us per call}}, the levels taking turns."""
    dtype = DTYPES[args.dtype]
    cases = {t: {name: call for name, call in kernels(t, dtype, args.seed).items() if name in args.kernels}
             for t in args.tokens}
    before = _C.cpu_isa()
    samples: dict[str, dict[str, list[float]]] = {}
    try:
        for _ in range(args.rounds):
            for level in levels:
                _C.set_cpu_isa(level)
                for t, calls in cases.items():
                    for name, (fn, _) in calls.items():
                        samples.setdefault(f"{name} T={t}", {}).setdefault(level, []).append(
                            us_per_call(fn, args.iters))
    finally:
        _C.set_cpu_isa(before)
    return {case: {level: statistics.median(v) for level, v in per.items()} for case, per in samples.items()}


def level_disagreement(args: argparse.Namespace, levels: list[str]) -> float:
    """The largest difference between any level's output and the CPU's own level's, over
    every kernel, relative to the allowed AGREE bound (<= 1 passes)."""
    dtype = DTYPES[args.dtype]
    outputs: dict[str, dict[str, torch.Tensor]] = {}
    before = _C.cpu_isa()
    try:
        for level in levels:
            _C.set_cpu_isa(level)
            for t in args.tokens:
                for name, (fn, written) in kernels(t, dtype, args.seed).items():
                    fn()
                    outputs.setdefault(f"{name} T={t}", {})[level] = written.double()
    finally:
        _C.set_cpu_isa(before)
    worst = 0.0
    for per in outputs.values():
        ref = per[levels[-1]]
        for out in per.values():
            worst = max(worst, ((out - ref).abs() / (1 + ref.abs())).max().item() / AGREE[dtype])
    return worst


def compare_builds(args: argparse.Namespace) -> None:
    child_args = ["--json", "--native-only", "--threads", str(args.threads), "--dtype", args.dtype, "--iters", str(args.iters), "--rounds",
                  str(args.rounds), "--tokens", *map(str, args.tokens), "--kernels", *args.kernels]
    load_before = os.getloadavg()
    runs = run_pairs(__file__, child_args, args.baseline, args.pairs)
    print(f"{args.pairs} pairs of processes, {args.dtype}, level {_C.cpu_isa()}; baseline {args.baseline}, "
          f"this {this_package()}")
    print(f"  {'kernel':<24} {'baseline us':>11} {'this us':>9} {'this/base':>9} (pairs)")
    for case in runs["this"][0]:
        base = [next(iter(r[case].values())) for r in runs["baseline"]]
        this = [next(iter(r[case].values())) for r in runs["this"]]
        ratios = [t / b for t, b in zip(this, base)]
        print(f"  {case:<24} {statistics.median(base):11.2f} {statistics.median(this):9.2f} "
              f"{statistics.median(ratios):8.2f}x ({min(ratios):.2f}-{max(ratios):.2f}x)")
    print(f"load (1/5/15 min): before {' '.join(f'{x:.2f}' for x in load_before)}, "
          f"after {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--iters", type=int, default=200, help="calls per timing")
    parser.add_argument("--rounds", type=int, default=5, help="timings per kernel and level (medians)")
    parser.add_argument("--tokens", nargs="+", type=int, default=[64, 512])
    parser.add_argument("--kernels", nargs="+", choices=KERNEL_NAMES, default=KERNEL_NAMES)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="OpenMP and torch threads")
    parser.add_argument("--baseline", default=None, help="another checkout's python/ directory to compare with")
    parser.add_argument("--pairs", type=int, default=5, help="with --baseline: pairs of processes")
    parser.add_argument("--native-only", action="store_true", help="only the CPU's own level")
    parser.add_argument("--levels", nargs="+", choices=LEVELS, default=None,
                        help="only these levels (default: every level up to the CPU's own)")
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--smoke", action="store_true", help="a seconds-long run of the same code path (quick lane)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.smoke:
        args.iters, args.rounds, args.tokens = 3, 1, [5, 64]
    if args.baseline is not None:
        if not os.path.isdir(os.path.join(args.baseline, "sarathi_rt")):
            raise SystemExit(f"--baseline must be a directory holding the sarathi_rt package, got {args.baseline!r}")
        compare_builds(args)
        return
    top = _C.cpu_isa()  # the CPU's own level, or the one SARATHI_RT_CPU_ISA lowers it to
    levels = [top] if args.native_only else LEVELS[:LEVELS.index(top) + 1]
    if args.levels is not None:
        if any(LEVELS.index(level) > LEVELS.index(top) for level in args.levels):
            raise SystemExit(f"--levels: this CPU runs at most {top}, got {' '.join(args.levels)}")
        levels = [level for level in LEVELS if level in args.levels]
    times = measure(args, levels)
    if args.json:
        print(json.dumps(times))
        return
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"{args.dtype}, us per call (median of {args.rounds} rounds of {args.iters} calls), load {load}:")
    dot = {"avx512", "avx512_bf16"} <= set(levels) and levels[0] != "avx512"  # else the first ratio is it
    print(f"  {'kernel':<24}" + "".join(f"{level:>12}" for level in levels) + f"   vs {levels[0]}"
          + ("   avx512/avx512_bf16" if dot else ""))
    for case, per in times.items():
        ratios = " ".join(f"{per[levels[0]] / per[level]:.2f}x" for level in levels[1:])
        vs_avx512 = f"   {per['avx512'] / per['avx512_bf16']:.2f}x" if dot else ""
        print(f"  {case:<24}" + "".join(f"{per[level]:12.2f}" for level in levels) + f"   {ratios}{vs_avx512}")
    worst = level_disagreement(args, levels)
    print(f"levels agree: worst difference {worst:.2f} of two roundings to {args.dtype} (must be <= 1)")
    if worst > 1:
        raise SystemExit(f"the levels' outputs differ by {worst:.2f} times the allowed two roundings")


if __name__ == "__main__":
    main()
