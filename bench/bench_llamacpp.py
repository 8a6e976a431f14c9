"""sarathi_rt's server side by side with llama.cpp's server, through one client.

    python bench/bench_llamacpp.py                     # build llama.cpp once, sweep its flags, F32 and BF16
    python bench/bench_llamacpp.py --llama-dir DIR     # an existing build: DIR/bin/llama-server, llama-quantize
    python bench/bench_llamacpp.py --repeats 2 --regimes poisson16,all64 --dtypes float32 \\
        --llama-flags "-b 512 -ub 512 -np 64"          # one flag set: no sweep
    python bench/bench_llamacpp.py --smoke             # seconds: sarathi_rt on `tiny` stands in for both sides

llama.cpp is the one vendored in the llama-cpp-python 0.3.36 sdist (fetched with pip, the
only network use), built once into $SARATHI_RT_CACHE/llama.cpp (default ~/.cache/sarathi_rt)
with cmake (Release, GGML_NATIVE; targets llama-server and llama-quantize; `--jobs`, default
1, as the machine is shared). llama-quantize dequantizes SmolLM2-135M-Instruct's shipped
Q4_1 GGUF to F32 and to BF16, and both servers load the same converted file, sarathi_rt at
the matching dtype, so both compute with the same values.

Each run starts one server alone (llama.cpp `-t T -tb T`, sarathi_rt `--threads T`, the
same T), sends one warm-up request, then `sarathi-rt bench --endpoint` (one client for both:
token-id prompts, greedy, ignore_eos, tokens counted from the server's usage) replays the
regime's workload (ShareGPT lengths x1/8): Poisson arrivals at 4 QPS with 16 and with 64
requests, and 64 requests all at once. The client's token count is checked against the
tokens the workload asked for. Repetitions interleave the sides (A B B A ...) so drift in
the machine's load falls on both. With several --llama-flags, each is first run once on
the all-at-once regime in F32 and the fastest is kept (llama.cpp's best flags). Prints per
dtype and regime the median output tok/s, TTFT P50 and P99 TBT of each side, the ratio
sarathi_rt / llama.cpp against the 1.5x target (issue 42), on the Poisson regimes the
tok/s their arrivals allow any server (and so the highest ratio reachable against llama.cpp's
figure), and the 1-minute load before and after every run; a run that started on a busy
machine is flagged.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tarfile
import time
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence

from sarathi_rt.cli import main as cli_main
from sarathi_rt.measure.metrics import load_requests_csv
from sarathi_rt.models.hub import cache_dir, named_model_path
from sarathi_rt.workloads import RequestSpec, WorkloadConfig, make_workload

TARGET_RATIO = 1.5
VERSION = "0.3.36"
TARGETS = ("llama-server", "llama-quantize")
CMAKE_FLAGS = ("-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_BUILD_TESTS=OFF",
               "-DLLAMA_BUILD_EXAMPLES=OFF", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_OPENSSL=OFF",
               "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_CURL=OFF")
GGUF_TYPES = {"float32": "F32", "bfloat16": "BF16"}
DEFAULT_LLAMA_FLAGS = ("-b 2048 -ub 512 -np 64", "-b 512 -ub 512 -np 64", "-b 512 -ub 512 -np 64 -kvu",
                       "-b 256 -ub 256 -np 64 -kvu")
LENGTH_SCALE = 1 / 8
SMOLLM2_VOCAB = 49152
# The 1-minute load includes our own previous run (one server on all T cores, decaying);
# above 1.5x the core count something else was competing for the cores.
BUSY_LOAD = 1.5 * (os.cpu_count() or 1)
START_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class Regime:
    name: str
    num_requests: int
    arrival: str  # "poisson", or "fixed" at 1e6 QPS: every request within 0.1 ms
    qps: float

    def bench_flags(self) -> list[str]:
        return ["--num-requests", str(self.num_requests), "--arrival", self.arrival, "--qps", f"{self.qps:g}"]


REGIMES = {r.name: r for r in (Regime("poisson16", 16, "poisson", 4.0), Regime("poisson64", 64, "poisson", 4.0),
                               Regime("all64", 64, "fixed", 1e6))}
SMOKE_REGIME = Regime("all4", 4, "fixed", 1e6)


@dataclass(frozen=True)
class Side:
    name: str
    argv: tuple[str, ...]  # the server's command line without host and port

    def command(self, port: int) -> list[str]:
        return [*self.argv, "--host", "127.0.0.1", "--port", str(port)]


@dataclass
class Run:
    side: str
    dtype: str
    regime: str
    repeat: int
    tokens_per_s: float
    ttft_p50: float
    tbt_p99: float
    load_before: float
    load_after: float

    @property
    def busy(self) -> bool:
        return self.load_before > BUSY_LOAD


def cmake_commands(source: Path, build: Path, jobs: int) -> list[list[str]]:
    """Configure and build llama-server and llama-quantize."""
    return [["cmake", "-S", str(source), "-B", str(build), *CMAKE_FLAGS],
            ["cmake", "--build", str(build), "-j", str(jobs), "--target", *TARGETS]]


def sdist_command(dest: Path) -> list[str]:
    """pip fetches the sdist; --no-binary names the package alone, as `:all:` would build
    its build requirements (cmake itself) from source too."""
    return [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-python",
            "--disable-pip-version-check", f"llama-cpp-python=={VERSION}", "-d", str(dest)]


def build_llama(root: Path, jobs: int) -> Path:
    """llama.cpp's bin directory under `root`, built there first when it is not."""
    bin_dir = root / "build" / "bin"
    if all((bin_dir / t).is_file() for t in TARGETS):
        return bin_dir
    root.mkdir(parents=True, exist_ok=True)
    sdist = root / f"llama_cpp_python-{VERSION}.tar.gz"
    if not sdist.is_file():
        subprocess.run(sdist_command(root), check=True)
    source = root / f"llama_cpp_python-{VERSION}" / "vendor" / "llama.cpp"
    if not source.is_dir():
        with tarfile.open(sdist) as tar:
            tar.extractall(root, filter="data")
    print(f"building llama.cpp in {root / 'build'} with -j {jobs} (about 6 min on 2 idle cores)", flush=True)
    for command in cmake_commands(source, root / "build", jobs):
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return bin_dir


def quantize_command(bin_dir: Path, source: Path, out: Path, dtype: str) -> list[str]:
    return [str(bin_dir / "llama-quantize"), "--allow-requantize", str(source), str(out), GGUF_TYPES[dtype]]


def convert(bin_dir: Path, source: Path, dtype: str, out_dir: Path) -> Path:
    """`source` dequantized to `dtype` by llama-quantize (kept beside the build, reused)."""
    out = out_dir / f"{source.name.split('.')[0]}.{GGUF_TYPES[dtype]}.gguf"
    if not out.is_file():
        out_dir.mkdir(parents=True, exist_ok=True)  # with --llama-dir, build_llama never made it
        partial = out.with_suffix(".partial")
        subprocess.run(quantize_command(bin_dir, source, partial, dtype), check=True, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)
        os.replace(partial, out)
    return out


def slots(flags: str) -> int:
    """The -np of a llama-server flag string (it sizes the context)."""
    words = shlex.split(flags)
    for name in ("-np", "--parallel"):
        if name in words and words.index(name) + 1 < len(words):
            return int(words[words.index(name) + 1])
    raise ValueError(f"--llama-flags {flags!r} must give -np (the context is sized per slot)")


def llama_side(bin_dir: Path, model: Path, threads: int, flags: str, longest: int) -> Side:
    """llama-server on `model`: a context of every slot at the longest request (shared by
    them with -kvu), continuous batching, no prompt cache (each prompt is new anyway)."""
    context = -(-slots(flags) * longest // 256) * 256
    return Side("llama.cpp", (str(bin_dir / "llama-server"), "-m", str(model), "-t", str(threads), "-tb",
                              str(threads), "-c", str(context), "-cb", "--no-cache-prompt", *shlex.split(flags)))


def sarathi_side(model: str, dtype: str, threads: int, name: str = "sarathi_rt") -> Side:
    return Side(name, (sys.executable, "-m", "sarathi_rt", "serve", "--model", model, "--dtype", dtype,
                       "--threads", str(threads), "--log-level", "warning"))


def interleave(sides: Sequence[Side], repeats: int) -> list[tuple[int, Side]]:
    """A B, B A, A B ...: each repetition reverses the previous order."""
    return [(r, side) for r in range(repeats) for side in (sides if r % 2 == 0 else list(reversed(sides)))]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def serving(side: Side, log: Path) -> Iterator[str]:
    """Starts `side`'s server, yields its base URL once /health answers 200, stops it."""
    import httpx

    port = free_port()
    with log.open("w") as out:
        proc = subprocess.Popen(side.command(port), stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{side.name} exited {proc.returncode} at start-up; see {log}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{side.name} not ready after {START_TIMEOUT_S:g} s; see {log}")
            time.sleep(0.2)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def warm_up(url: str, model: str) -> None:
    """One short request: first-call allocations and page faults stay out of the run."""
    import httpx

    body = {"model": model, "prompt": list(range(1, 17)), "max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    httpx.post(f"{url}/completions", json=body, timeout=120.0).raise_for_status()


def workload(regime: Regime, length_scale: float, seed: int) -> list[RequestSpec]:
    """The requests `sarathi-rt bench` makes of these flags (no context limit: checked after)."""
    return make_workload(WorkloadConfig(num_requests=regime.num_requests, qps=regime.qps, arrival=regime.arrival,
                                        lengths="sharegpt", length_scale=length_scale, seed=seed))


def arrival_ceiling(specs: Sequence[RequestSpec]) -> float | None:
    """The output tok/s no server can exceed on these requests: tokens over the span from
    the first arrival to the last (a server whose steps took no time finishes each request
    as it arrives). None when they all arrive at once. On the Poisson regimes it bounds
    the ratio to llama.cpp at ceiling / llama.cpp's tok/s, however fast our steps get."""
    arrivals = [s.arrival_time for s in specs]
    span = max(arrivals) - min(arrivals)
    return sum(s.num_decode_tokens for s in specs) / span if span > 0 else None


def bench_args(url: str, regime: Regime, length_scale: float, vocab_size: int, seed: int, out: Path) -> list[str]:
    """`sarathi-rt bench --endpoint`'s arguments (run in this process: one client for both)."""
    return ["bench", "--endpoint", url, *regime.bench_flags(), "--trace",
            "sharegpt", "--length-scale", f"{length_scale:g}", "--vocab-size", str(vocab_size), "--seed", str(seed),
            "--out", str(out)]


def run_once(side: Side, regime: Regime, args: argparse.Namespace, out: Path, expected_tokens: int) -> dict:
    """One server start, warm-up and client replay; the client's summary and the loads."""
    from sarathi_rt.harness.http_replay import server_model

    out.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()[0]
    with serving(side, out / "server.log") as url:
        warm_up(url, str(server_model(url)["id"]))
        with (out / "client.log").open("w") as log, redirect_stdout(log), redirect_stderr(log):
            code = cli_main(bench_args(url, regime, args.length_scale, args.vocab_size, args.seed, out))
        if code != 0:
            raise RuntimeError(f"sarathi-rt bench --endpoint exited {code} against {side.name}; see {out}")
    counted = sum(r.num_generated_tokens for r in load_requests_csv(out / "endpoint_requests.csv"))
    if counted != expected_tokens:
        raise RuntimeError(f"{side.name}: the client counted {counted} output tokens, the workload asked for "
                           f"{expected_tokens} (ignore_eos); see {out}")
    summary = json.loads((out / "summary.json").read_text())["endpoint"]
    return {**summary, "load_before": load_before, "load_after": os.getloadavg()[0]}


def measure(sides: Sequence[Side], dtype: str, regime: Regime, args: argparse.Namespace, out: Path) -> list[Run]:
    specs = workload(regime, args.length_scale, args.seed)
    expected = sum(s.num_decode_tokens for s in specs)
    runs = []
    for repeat, side in interleave(sides, args.repeats):
        r = run_once(side, regime, args, out / dtype / regime.name / f"{side.name}-{repeat}", expected)
        runs.append(Run(side.name, dtype, regime.name, repeat, r["tokens_per_s"], r["ttft_p50"], r["tbt_p99"],
                        r["load_before"], r["load_after"]))
        print(f"  {dtype} {regime.name} #{repeat} {side.name:<10} {r['tokens_per_s']:7.1f} tok/s  load "
              f"{r['load_before']:.1f} -> {r['load_after']:.1f}{'  BUSY' if runs[-1].busy else ''}", flush=True)
    return runs


def summarize(runs: Sequence[Run], ours: str, peer: str,
              ceilings: dict[str, float | None] | None = None) -> list[str]:
    """Per dtype and regime: each side's medians, then the ratio line (with the regime's
    arrival_ceiling, where `ceilings` has one, and the ratio that ceiling allows)."""
    lines = [f"{'dtype':<9} {'regime':<10} {'side':<10} {'tok/s':>7} {'TTFT P50':>9} {'TBT P99':>8}  "
             "load before -> after (each run)"]
    groups = sorted({(r.dtype, r.regime) for r in runs}, key=lambda g: [(r.dtype, r.regime) for r in runs].index(g))
    for dtype, regime in groups:
        medians: dict[str, float] = {}
        for side in (ours, peer):
            mine = [r for r in runs if (r.dtype, r.regime, r.side) == (dtype, regime, side)]
            medians[side] = statistics.median(r.tokens_per_s for r in mine)
            loads = ", ".join(f"{r.load_before:.1f}->{r.load_after:.1f}{'*' if r.busy else ''}" for r in mine)
            lines.append(f"{dtype:<9} {regime:<10} {side:<10} {medians[side]:7.1f} "
                         f"{statistics.median(r.ttft_p50 for r in mine):8.3f}s "
                         f"{1e3 * statistics.median(r.tbt_p99 for r in mine):6.0f}ms  {loads}")
        busy = sum(r.busy for r in runs if (r.dtype, r.regime) == (dtype, regime))
        ratio = medians[ours] / medians[peer] if medians[peer] > 0 else float("nan")
        ceiling = (ceilings or {}).get(regime)
        lines.append(f"{dtype} {regime}: ratio {ours} / {peer} {ratio:.2f}x (target >= {TARGET_RATIO}x)"
                     + (f"; arrivals cap any server at {ceiling:.0f} tok/s, a ratio of "
                        f"{ceiling / medians[peer]:.2f}x" if ceiling is not None and medians[peer] > 0 else "")
                     + (f"; {busy} run(s) started on a busy machine (load > {BUSY_LOAD:g}, marked *)" if busy else ""))
    return lines


def best_llama_flags(candidates: Sequence[str], make: Callable[[str], Side], args: argparse.Namespace,
                     out: Path) -> str:
    """The flag set with the most output tok/s on the all-at-once regime, one run each."""
    regime = REGIMES["all64"]
    expected = sum(s.num_decode_tokens for s in workload(regime, args.length_scale, args.seed))
    speeds = {}
    for i, flags in enumerate(candidates):
        r = run_once(make(flags), regime, args, out / "sweep" / f"flags-{i}", expected)
        speeds[flags] = r["tokens_per_s"]
        print(f"  sweep {flags!r}: {speeds[flags]:.1f} tok/s (load {r['load_before']:.1f} -> {r['load_after']:.1f})",
              flush=True)
    return max(speeds, key=speeds.__getitem__)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-dir", type=Path, help="an existing llama.cpp build (holding bin/llama-server)")
    ap.add_argument("--jobs", type=int, default=1, help="cmake build jobs (default 1: the machine is shared)")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--regimes", default=",".join(REGIMES))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2, help="both servers' threads (llama.cpp -t/-tb)")
    ap.add_argument("--llama-flags", action="append", help="llama-server flags to try (repeatable; several: "
                                                           f"sweep). Default: {list(DEFAULT_LLAMA_FLAGS)}")
    ap.add_argument("--length-scale", type=float, default=LENGTH_SCALE)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("bench_llamacpp_out"))
    ap.add_argument("--smoke", action="store_true", help="sarathi_rt on `tiny` stands in for both sides; seconds")
    args = ap.parse_args()
    # A SIGTERM (timeout, kill) unwinds like Ctrl-C, so `serving` stops the server it started.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    dtypes = [d for d in args.dtypes.split(",") if d]
    unknown = [d for d in dtypes if d not in GGUF_TYPES] + [r for r in args.regimes.split(",") if r not in REGIMES]
    if unknown or args.repeats < 1:
        raise SystemExit(f"--dtypes must be of {list(GGUF_TYPES)}, --regimes of {list(REGIMES)} and --repeats >= 1; "
                         f"got {unknown or args.repeats}")
    load = os.getloadavg()
    print(f"bench_llamacpp: load {load[0]:.1f} {load[1]:.1f} {load[2]:.1f} on {os.cpu_count()} cores"
          + (" (BUSY: figures are not a quiet-machine comparison)" if load[0] > BUSY_LOAD else ""), flush=True)
    if args.smoke:
        args.repeats, args.length_scale, args.vocab_size = 1, 1 / 16, 512
        sides = [sarathi_side("tiny", "float32", args.threads),
                 sarathi_side("tiny", "float32", args.threads, "stand-in")]
        print("smoke: sarathi_rt on `tiny` stands in for llama.cpp (no build)")
        runs = measure(sides, "float32", SMOKE_REGIME, args, args.out)
        print("\n".join(summarize(runs, "sarathi_rt", "stand-in")))
        return
    args.vocab_size = SMOLLM2_VOCAB
    regimes = [REGIMES[r] for r in args.regimes.split(",")]
    root = cache_dir() / "llama.cpp"
    bin_dir = (args.llama_dir / "bin") if args.llama_dir else build_llama(root, args.jobs)
    source = named_model_path("smollm2-135m-instruct")
    longest = max(s.num_prompt_tokens + s.num_decode_tokens for r in regimes for s in
                  workload(r, args.length_scale, args.seed))
    models = {d: convert(bin_dir, source, d, root) for d in dtypes}
    candidates = args.llama_flags or list(DEFAULT_LLAMA_FLAGS)
    flags = candidates[0]
    if len(candidates) > 1:
        print(f"sweeping {len(candidates)} llama-server flag sets on all64 in {dtypes[0]}", flush=True)
        flags = best_llama_flags(candidates, lambda f: llama_side(bin_dir, models[dtypes[0]], args.threads, f,
                                                                  longest), args, args.out)
    print(f"llama.cpp flags: -t {args.threads} -tb {args.threads} {flags}; sarathi_rt --threads {args.threads}",
          flush=True)
    runs: list[Run] = []
    for dtype in dtypes:
        sides = [sarathi_side(str(models[dtype]), dtype, args.threads),
                 llama_side(bin_dir, models[dtype], args.threads, flags, longest)]
        for regime in regimes:
            runs += measure(sides, dtype, regime, args, args.out)
    (args.out / "runs.json").write_text(json.dumps([asdict(r) for r in runs], indent=1))
    # All at once (qps 1e6) the arrivals span microseconds: no ceiling worth printing.
    ceilings = {r.name: arrival_ceiling(workload(r, args.length_scale, args.seed)) if r.arrival == "poisson" else None
                for r in regimes}
    print("\n".join(summarize(runs, "sarathi_rt", "llama.cpp", ceilings)))
    print(f"(medians over {args.repeats} interleaved repetitions; runs in {args.out}/runs.json)")


if __name__ == "__main__":
    main()
