"""How far the engine's steps are from this machine's limits: the roofline on the CPU.

    python bench/bench_roofline_cpu.py [--threads N] [--dtypes float32,bfloat16] [--repeats 3]
                                       [--decodes 1,8,32,64,128] [--prefill 64,128,256,512] [--context 256]

First the machine: the GEMM peak of each dtype (a large torch linear, the op the model's
projections run) and the memory bandwidth (a streaming copy, read + write bytes). Then
the engine on the real model (SmolLM2-135M-Instruct, from the cache) runs synthetic
steps (`harness.step_timing`): each decode batch at `--context` cached tokens, and each
prefill chunk as a prompt's only chunk. Every step is timed bare (ms/step, and from it
the achieved GFLOP/s and GB/s against the compute and memory bounds of
`measure.roofline`) and again with timing hooks that split it into the linear layers
(the layers' projections), the LM head (with its row gather and final norm), attention
(rotary, KV write, the attention kernel), other ops (embedding, norms, SiLU, the layer loop),
sampling, and the engine's Python (the step's wall time less the forward, the logits
and the sampling: preparing the step context, building the output). All figures are
medians over `--repeats` rounds; each round runs every step of every dtype once, in a
shuffled order (`time_steps`), so a change in the machine's speed lands on every row.

The target: a batch-64 decode step in bfloat16 at >= 50% of the compute bound, judged
against the bfloat16 peak measured here; a CPU without native bf16 (AVX512-BF16, AMX)
runs torch's bf16 GEMM in software, and the output says so. The 1-minute load average
is read before and after: a run that shared the machine prints a warning line.

`--smoke` runs the `tiny` random-weight preset (never downloads) for a few seconds.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

# The native kernels size their OpenMP team when the library loads: give them the same
# thread count as torch (--threads) before anything imports it.
_threads = sys.argv[sys.argv.index("--threads") + 1] if "--threads" in sys.argv else str(os.cpu_count() or 1)
os.environ.setdefault("OMP_NUM_THREADS", _threads)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from sarathi_rt import LLM  # noqa: E402
from sarathi_rt.engine.executor import InProcessExecutor  # noqa: E402
from sarathi_rt.engine.worker import Worker  # noqa: E402
from sarathi_rt.measure.roofline import ModelCost, StepRow, busy_warning, step_bytes, step_flops  # noqa: E402
from sarathi_rt.harness.step_split import StepSplit  # noqa: E402
from sarathi_rt.harness.step_timing import time_steps  # noqa: E402
from sarathi_rt.sim.budget import SyntheticRow  # noqa: E402
from sarathi_rt.utils.cpu import BF16_EMULATE, BF16_ENV, cpu_flags, missing_bf16  # noqa: E402

MODEL = "smollm2-135m-instruct"
TARGET_BATCH, TARGET_FRACTION = 64, 0.5
SPLIT = ("linear", "head", "attention", "other", "sampling", "python")


def gemm_peaks(dtypes: list[torch.dtype], size: int, repeats: int) -> dict[torch.dtype, float]:
    """Median FLOP/s of a size x size x size linear per dtype, the dtypes interleaved."""
    pairs = {dt: (torch.randn(size, size).to(dt), torch.randn(size, size).to(dt)) for dt in dtypes}
    times: dict[torch.dtype, list[float]] = {dt: [] for dt in dtypes}
    for dt, (a, w) in pairs.items():
        F.linear(a, w)  # first-call costs
    for _ in range(repeats):
        for dt, (a, w) in pairs.items():
            start = time.perf_counter()
            F.linear(a, w)
            times[dt].append(time.perf_counter() - start)
    return {dt: 2 * size ** 3 / statistics.median(t) for dt, t in times.items()}


def copy_bandwidth(mib: int, repeats: int) -> float:
    """Median bytes/s of a streaming copy (read + write) of `mib` MiB, far past the caches."""
    src = torch.ones(mib << 18, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return 2 * src.numel() * 4 / statistics.median(times)


def split_ms(split: StepSplit, wall: float) -> dict[str, float]:
    """The executor step's `wall` seconds by SPLIT category, in ms: preparing the step
    context counts as the engine's Python, with whatever no timer saw."""
    ms = split.ms(wall)
    return {"linear": ms["linear"], "head": ms["logits"], "attention": ms["attention"], "other": ms["other"],
            "sampling": ms["sampling"], "python": ms["prepare"] + ms["python"]}


def model_cost(worker: Worker) -> ModelCost:
    model = worker.model
    layer_params = sum(m.weight.numel() for kind, m in model.timed_regions() if kind == "linear")
    assert model.lm_head is not None
    unique = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}
    return ModelCost(layer_params, model.lm_head.numel(), sum(unique.values()),
                     worker.kv_shape.bytes_per_block // worker.kv_shape.block_size)


def regimes(decodes: list[int], prefill: list[int], context: int) -> list[tuple[str, list[SyntheticRow]]]:
    steps = [(f"decode x{b}", [SyntheticRow(context, 1, False, True)] * b) for b in decodes]
    return steps + [(f"prefill {n}", [SyntheticRow(0, n, True, True)]) for n in prefill]


def worker_of(llm: LLM) -> Worker:
    executor = llm.engine.executor
    if not isinstance(executor, InProcessExecutor):
        raise TypeError("the roofline bench times the in-process executor's one worker")
    return executor.worker


def measure(llms: dict[torch.dtype, LLM], steps: list[list[SyntheticRow]], repeats: int
            ) -> dict[torch.dtype, list[tuple[float, dict[str, float]]]]:
    """Per dtype, per step: (median bare seconds, median split ms). Each round runs every
    dtype's steps bare, then instrumented, the dtypes alternating which goes first."""
    bare: dict[torch.dtype, list[list[float]]] = {dt: [[] for _ in steps] for dt in llms}
    split: dict[torch.dtype, list[list[dict[str, float]]]] = {dt: [[] for _ in steps] for dt in llms}
    order = list(llms)
    for dt in order:  # warm-up: first-call costs of every shape
        time_steps(llms[dt].engine, steps, repeats=1, warmup=0)
    for r in range(repeats):
        for dt in (order if r % 2 == 0 else order[::-1]):
            engine, worker = llms[dt].engine, worker_of(llms[dt])
            for i, t in enumerate(time_steps(engine, steps, repeats=1, warmup=0, seed=r)):
                bare[dt][i] += t
            with StepSplit(worker) as hooks:
                for i, rows in enumerate(steps):
                    hooks.reset()
                    wall = time_steps(engine, [rows], repeats=1, warmup=0)[0][0]
                    split[dt][i].append(split_ms(hooks, wall))
    return {dt: [(statistics.median(bare[dt][i]),
                  {k: statistics.median(s[k] for s in split[dt][i]) for k in SPLIT}) for i in range(len(steps))]
            for dt in llms}


def rows_of(synthetic: list[SyntheticRow]) -> list[StepRow]:
    return [StepRow(r.start_pos, r.num_tokens, r.samples) for r in synthetic]


def report(dt: torch.dtype, names: list[str], steps: list[list[SyntheticRow]],
           results: list[tuple[float, dict[str, float]]], cost: ModelCost, peak: float, bandwidth: float) -> None:
    name = str(dt).removeprefix("torch.")
    print(f"\n{name}: compute bound at {peak / 1e9:.1f} GFLOP/s, memory bound at {bandwidth / 1e9:.1f} GB/s; "
          f"{cost.layer_params / 1e6:.1f} M layer + {cost.head_params / 1e6:.1f} M head weights, "
          f"{cost.weight_bytes / 2**20:.0f} MiB, KV {cost.kv_bytes_per_token / 1024:.1f} KiB/token")
    print(f"{'regime':<13}|{'tokens':>7} |{'ms/step':>9} |{'GFLOP/s':>8} |{'% comp':>7} |{'GB/s':>6} |{'% mem':>6} |"
          + "".join(f"{k:>10}" for k in SPLIT) + "  (split ms)")
    for label, rows, (wall, split) in zip(names, steps, results):
        flops, nbytes = step_flops(cost, rows_of(rows)), step_bytes(cost, rows_of(rows))
        print(f"{label:<13}|{sum(r.num_tokens for r in rows):>7} |{wall * 1e3:>9.2f} |{flops / wall / 1e9:>8.1f} |"
              f"{100 * flops / wall / peak:>6.1f}% |{nbytes / wall / 1e9:>6.2f} |"
              f"{100 * nbytes / wall / bandwidth:>5.1f}% |"
              + "".join(f"{split[k]:>10.2f}" for k in SPLIT))


def verdict(dt: torch.dtype, batch: int, rows: list[SyntheticRow], result: tuple[float, dict[str, float]],
            cost: ModelCost, peaks: dict[torch.dtype, float], missing: tuple[str, ...]) -> None:
    """The target line, and where the step's time goes when it falls short."""
    wall, split = result
    peak = peaks[dt]
    fraction = step_flops(cost, rows_of(rows)) / wall / peak
    name = str(dt).removeprefix("torch.")
    print(f"\ndecode x{batch} in {name}: {100 * fraction:.1f}% of the compute bound "
          f"(target >= {100 * TARGET_FRACTION:.0f}%): {'met' if fraction >= TARGET_FRACTION else 'short'}")
    if fraction < TARGET_FRACTION:
        tokens, logit_rows = sum(r.num_tokens for r in rows), sum(r.samples for r in rows)
        layer_rate = 2 * cost.layer_params * tokens / max(split["linear"] / 1e3, 1e-9)
        head_rate = 2 * cost.head_params * logit_rows / max(split["head"] / 1e3, 1e-9)
        share = ", ".join(f"{k} {v:.2f} ms ({100 * v / sum(split.values()):.0f}%)"
                          for k, v in sorted(split.items(), key=lambda kv: -kv[1]))
        print(f"  where the time goes: {share}")
        print(f"  the layers' projections run at {layer_rate / 1e9:.1f} GFLOP/s ({100 * layer_rate / peak:.0f}% of "
              f"the {name} GEMM peak), the LM head at {head_rate / 1e9:.1f} GFLOP/s ({100 * head_rate / peak:.0f}%)")
    if dt == torch.bfloat16 and missing:
        print(f"  the bfloat16 peak is emulated: this CPU lacks {' and '.join(missing)}, so torch's bf16 GEMM "
              "converts to float32 in software")
        if torch.float32 in peaks:  # the machine's real compute bound, where bf16 only halves the bytes
            print(f"  against the float32 GEMM peak ({peaks[torch.float32] / 1e9:.1f} GFLOP/s) this step reaches "
                  f"{100 * step_flops(cost, rows_of(rows)) / wall / peaks[torch.float32]:.1f}%")


def parse_ints(text: str, name: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x]
    except ValueError:
        raise SystemExit(f"--{name} must be comma-separated positive ints, got {text!r}") from None
    if not values or min(values) < 1:
        raise SystemExit(f"--{name} must be comma-separated positive ints, got {text!r}")
    return values


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch/OpenMP threads (default: all)")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--decodes", default="1,8,32,64,128")
    ap.add_argument("--prefill", default="64,128,256,512")
    ap.add_argument("--context", type=int, default=256, help="cached tokens of every decode")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--gemm-size", type=int, default=1024)
    ap.add_argument("--copy-mib", type=int, default=256)
    ap.add_argument("--smoke", action="store_true", help="a seconds-long run on `tiny` (quick lane)")
    args = ap.parse_args()
    model = MODEL
    if args.smoke:
        model, args.decodes, args.prefill, args.context, args.repeats = "tiny", "1,8", "16,32", 32, 1
        args.threads = 1
        args.gemm_size, args.copy_mib = 128, 8
    decodes, prefill = parse_ints(args.decodes, "decodes"), parse_ints(args.prefill, "prefill")
    dtypes = [getattr(torch, d, None) for d in args.dtypes.split(",")]
    if not dtypes or any(dt not in (torch.float32, torch.bfloat16) for dt in dtypes):
        raise SystemExit(f"--dtypes must name float32 and/or bfloat16, got {args.dtypes!r}")
    if args.threads < 1 or args.repeats < 1 or args.context < 0:
        raise SystemExit("--threads and --repeats must be >= 1 and --context >= 0")
    torch.set_num_threads(args.threads)
    cores = os.cpu_count() or 1
    load_before, start = os.getloadavg()[0], time.perf_counter()
    missing = missing_bf16(cpu_flags())

    peaks = gemm_peaks(dtypes, args.gemm_size, 5)
    bandwidth = copy_bandwidth(args.copy_mib, 5)
    print(f"torch {torch.__version__}, {args.threads} thread(s) on {cores} cores; load before {load_before:.2f}")
    print(f"machine: streaming copy {bandwidth / 1e9:.1f} GB/s; GEMM {args.gemm_size}^3 "
          + ", ".join(f"{str(dt).removeprefix('torch.')} {p / 1e9:.1f} GFLOP/s" for dt, p in peaks.items())
          + (f" (bfloat16 emulated: the CPU lacks {', '.join(missing)})" if missing and torch.bfloat16 in peaks
             else ""))

    named = regimes(decodes, prefill, args.context)
    names, steps = [n for n, _ in named], [s for _, s in named]
    block = 16
    blocks = max(sum(-(-(r.start_pos + r.num_tokens) // block) for r in rows) for rows in steps)
    # --dtypes bfloat16 measures bfloat16 even where it is emulated (the output says so),
    # rather than the float32 an engine falls back to there.
    os.environ.setdefault(BF16_ENV, BF16_EMULATE)
    llms = {dt: LLM(model, dtype=dt, block_size=block, num_kv_blocks=blocks, max_num_seqs=max(decodes),
                    token_budget=max(prefill + decodes)) for dt in dtypes}
    results = measure(llms, steps, args.repeats)
    batch = TARGET_BATCH if TARGET_BATCH in decodes else max(decodes)
    for dt in dtypes:
        cost = model_cost(worker_of(llms[dt]))
        report(dt, names, steps, results[dt], cost, peaks[dt], bandwidth)
        i = names.index(f"decode x{batch}")
        verdict(dt, batch, steps[i], results[dt][i], cost, peaks, missing)
    if len(dtypes) == 2:
        ratios = [b[0] / f[0] for f, b in zip(results[torch.float32], results[torch.bfloat16])]
        print("\nbfloat16 / float32 ms/step: " + ", ".join(f"{n} {r:.2f}x" for n, r in zip(names, ratios)))
    load_after = os.getloadavg()[0]
    print(f"\nload: before {load_before:.2f}, after {load_after:.2f} (1-minute average; {cores} cores)")
    warning = busy_warning(load_before, load_after, cores=cores, threads=args.threads,
                           run_seconds=time.perf_counter() - start)
    if warning:
        print(warning)


if __name__ == "__main__":
    main()
