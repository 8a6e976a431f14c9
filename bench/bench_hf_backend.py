"""The transformers-backed model path (model_impl="transformers") against the native one
and against transformers' own continuous batching, on the CPU, in float32.

    python bench/bench_hf_backend.py [--repeats 3] [--max-tokens 32] [--threads N]

Part A: SmolLM2-135M-Instruct (its Q4_1 GGUF, dequantized by transformers and saved once
as a Hugging Face directory under the model cache, keyed by the file) through
`LLM(dir, model_impl="native")` and `LLM(dir, model_impl="transformers")`: the 16-chat set
and 64 ShareGPT-length requests (lengths / 32, random token ids), every request greedy to
a fixed length. The two engines alternate (A, B, A, B, ...) so the machine's drift lands
on both; prints output tokens/s medians, the median of the pairs' ratios against the
target (>= 0.8x native), and whether the greedy outputs are identical.

Part B: a Qwen3-shaped random model (hidden 512, 6 layers, vocab 32000, q/k norms: an
architecture with no native family here) in a temporary directory, run by our
transformers-backed path and by transformers' `generate_batch` (its continuous batching,
paged cache, sdpa) on the same requests (48 ShareGPT-length requests / 32), alternating; ratio against the
target (>= 2x transformers' continuous batching). Every engine here, and generate_batch,
runs at most 512 tokens a step, and our engines keep no prefix cache between runs.

Both wall tokens/s and CPU tokens/s (process CPU time: steadier while other jobs share
the machine) are printed, with the host's kernel ISA, torch threads, load and commit.
`--smoke` runs the same code on bench_gguf_load.py's tiny LLaMA GGUF (no download)
and a tiny Qwen3, one pair each, in seconds.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# The native kernels size their OpenMP team when the library loads: match torch's (--threads).
if "--threads" in sys.argv:
    os.environ.setdefault("OMP_NUM_THREADS", sys.argv[sys.argv.index("--threads") + 1])

import torch  # noqa: E402

from sarathi_rt import LLM, SamplingParams  # noqa: E402
from sarathi_rt.models import resolve_model_path  # noqa: E402
from sarathi_rt.models.hub import cache_dir  # noqa: E402
from sarathi_rt.utils.cpu import kernel_isa  # noqa: E402
from sarathi_rt.workloads import WorkloadConfig, make_workload  # noqa: E402
from bench_gguf_load import smoke_model  # noqa: E402  (its tiny LLaMA GGUF with a chat template)

TESTS = Path(__file__).resolve().parents[1] / "tests"
MODEL = "smollm2-135m-instruct"
NATIVE_TARGET, CB_TARGET = 0.8, 2.0
QWEN3 = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=6, num_attention_heads=8,
             num_key_value_heads=4, head_dim=64, vocab_size=32000, max_position_embeddings=4096)
QWEN3_SMOKE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, vocab_size=512, max_position_embeddings=256)


@dataclass
class Run:
    """One side's run over the request set."""

    wall_s: float
    cpu_s: float
    outputs: list[list[int]]

    @property
    def tokens(self) -> int:
        return sum(map(len, self.outputs))


Side = Callable[[list[list[int]]], list[list[int]]]  # prompts -> each one's greedy output


def timed(side: Side, prompts: list[list[int]]) -> Run:
    cpu, wall = time.process_time(), time.perf_counter()
    outputs = side(prompts)
    return Run(time.perf_counter() - wall, time.process_time() - cpu, outputs)


def converted(gguf: Path, root: Path) -> Path:
    """The Hugging Face directory transformers makes of `gguf` (dequantized to float32),
    written once under `root` and reused: the key is the file's name, size and mtime."""
    stat = gguf.stat()
    out = root / f"{gguf.stem}-{stat.st_size}-{stat.st_mtime_ns}"
    if (out / "config.json").is_file():
        return out
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The GGUF load marks the model quantized, which save_pretrained refuses: rebuild the
    # same class from the plain config and hand it the dequantized weights.
    config = loaded.config
    del config.quantization_config
    plain = type(loaded)(config).float()
    plain.load_state_dict(loaded.state_dict())
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    plain.save_pretrained(tmp)
    tmp.rename(out)
    return out


def random_qwen3(root: Path, shape: dict[str, int]) -> Path:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**shape, initializer_range=0.2)).float()
    model.generation_config.eos_token_id = None  # every request runs to its length
    model.save_pretrained(root / "qwen3")
    return root / "qwen3"


def workload_prompts(n: int, vocab: int, max_total: int, scale: float, seed: int) -> list[list[int]]:
    specs = make_workload(WorkloadConfig(num_requests=n, lengths="sharegpt", length_scale=scale,
                                         max_total_tokens=max_total, seed=seed))
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(s.num_prompt_tokens)] for s in specs]


# Tokens per step on both sides: our token budget and generate_batch's max_batch_tokens.
BATCH_TOKENS = 512


def engine(path: Path, impl: str, tokenizer: Path | None, requests: int) -> LLM:
    # No prefix cache: every run prefills its prompts, as generate_batch does.
    return LLM(path, model_impl=impl, tokenizer=tokenizer, dtype="float32", max_num_seqs=requests,
               token_budget=BATCH_TOKENS, enable_prefix_caching=False)


def ours(llm: LLM, max_tokens: int) -> Side:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return lambda prompts: [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def continuous_batching(path: Path, max_tokens: int) -> Side:
    """transformers' generate_batch on the same weights, greedy, a paged cache sized for
    every request at once (the same concurrency our engine gets)."""
    from transformers import AutoModelForCausalLM, GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    gen = GenerationConfig(max_new_tokens=max_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)

    def run(prompts: list[list[int]]) -> list[list[int]]:
        page = 16
        blocks = sum(-(-(len(p) + max_tokens) // page) for p in prompts) + len(prompts)
        config = ContinuousBatchingConfig(page_size=page, num_blocks=blocks, max_batch_tokens=BATCH_TOKENS,
                                          max_requests_per_batch=len(prompts))
        with torch.inference_mode():
            out = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=config)
        return [list(r.generated_tokens) for r in out.values()]
    return run


def pairs(sides: dict[str, Side], prompts: list[list[int]], repeats: int) -> dict[str, list[Run]]:
    """Each side warms up on two of the prompts, then `repeats` rounds of all of them,
    alternating which side goes first."""
    names = list(sides)
    for name in names:
        sides[name](prompts[:2])
    runs: dict[str, list[Run]] = {name: [] for name in names}
    for r in range(repeats):
        for name in (names if r % 2 == 0 else names[::-1]):
            runs[name].append(timed(sides[name], prompts))
    return runs


def report(title: str, runs: dict[str, list[Run]], target: float) -> None:
    """Prints each side's tokens/s medians and the median of the pairs' ratios (first side
    over second), wall and CPU; the verdict reads the wall ratio."""
    (a, ra), (b, rb) = runs.items()
    print(f"{title}: {ra[0].tokens} output tokens per run, {len(ra)} pairs")
    for name, rs in runs.items():
        wall = [r.tokens / r.wall_s for r in rs]
        cpu = [r.tokens / r.cpu_s for r in rs]
        print(f"  {name:<34} {statistics.median(wall):8.1f} tok/s wall ({', '.join(f'{x:.1f}' for x in wall)}), "
              f"{statistics.median(cpu):8.1f} tok/s per CPU second")
    wall = statistics.median(y.wall_s / x.wall_s for x, y in zip(ra, rb))
    cpu = statistics.median(y.cpu_s / x.cpu_s for x, y in zip(ra, rb))
    verdict = "met" if wall >= target else "not met"
    print(f"  ratio {a} / {b}: {wall:.2f}x wall, {cpu:.2f}x CPU (median of pairs; target >= {target}x: {verdict}); "
          f"load {os.getloadavg()[0]:.1f}")


def same_outputs(label: str, runs: dict[str, list[Run]]) -> None:
    (_, ra), (_, rb) = runs.items()
    same = sum(x == y for x, y in zip(ra[-1].outputs, rb[-1].outputs))
    print(f"  greedy outputs identical ({label}): {same}/{len(ra[-1].outputs)}")


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).parent, check=True,
                              capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"


def part_a(gguf: Path, root: Path, args: argparse.Namespace) -> None:
    hf_dir = converted(gguf, root)
    llms = {impl: engine(hf_dir, impl, gguf, args.requests) for impl in ("transformers", "native")}
    sys.path.insert(0, str(TESTS))
    from smollm2_chats import CONVERSATIONS

    tok = llms["native"].tokenizer
    chats = [tok.apply_chat_template(c) for c in CONVERSATIONS[:args.chats]]
    context = min(1024, llms["native"].engine.max_model_len)
    vocab = llms["native"].engine.model_config.vocab_size
    mixed = workload_prompts(args.requests, vocab, context - args.max_tokens, args.length_scale, seed=0)
    for label, prompts in ((f"{len(chats)} chats", chats), (f"{len(mixed)} ShareGPT / {1 / args.length_scale:.0f}",
                                                            mixed)):
        sides = {"transformers-backed": ours(llms["transformers"], args.max_tokens),
                 "native": ours(llms["native"], args.max_tokens)}
        runs = pairs(sides, prompts, args.repeats)
        report(f"A. {gguf.name} float32, transformers-backed vs native, {label} x {args.max_tokens} tokens",
               runs, NATIVE_TARGET)
        same_outputs(label, runs)
    for llm in llms.values():
        llm.shutdown()


def part_b(root: Path, args: argparse.Namespace) -> None:
    shape = QWEN3_SMOKE if args.smoke else QWEN3
    path = random_qwen3(root, shape)
    context = min(1024, shape["max_position_embeddings"])
    prompts = workload_prompts(args.cb_requests, shape["vocab_size"], context - args.max_tokens, args.length_scale,
                               seed=1)
    llm = engine(path, "transformers", None, len(prompts))
    sides = {"transformers-backed": ours(llm, args.max_tokens),
             "transformers generate_batch": continuous_batching(path, args.max_tokens)}
    runs = pairs(sides, prompts, args.repeats)
    report(f"B. random Qwen3 {shape['hidden_size']}x{shape['num_hidden_layers']} vocab {shape['vocab_size']} "
           f"float32, {len(prompts)} ShareGPT / {1 / args.length_scale:.0f} x {args.max_tokens} tokens", runs,
           CB_TARGET)
    same_outputs(f"{len(prompts)} requests", runs)
    llm.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3, help="pairs of runs per comparison")
    ap.add_argument("--max-tokens", type=int, default=32, help="output tokens per request (greedy, no eos)")
    ap.add_argument("--chats", type=int, default=16, help="chats of the 16-chat set in part A")
    ap.add_argument("--requests", type=int, default=64, help="ShareGPT-length requests in part A")
    ap.add_argument("--cb-requests", type=int, default=48, help="ShareGPT-length requests in part B")
    ap.add_argument("--length-scale", type=float, default=1 / 32, help="ShareGPT lengths times this")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch/OpenMP threads")
    ap.add_argument("--parts", default="AB", help="which parts to run (A, B or AB)")
    ap.add_argument("--smoke", action="store_true", help="a seconds-long run of the same code path (quick lane)")
    args = ap.parse_args()
    if args.smoke:
        args.repeats, args.max_tokens, args.chats, args.requests, args.cb_requests = 1, 4, 2, 4, 4
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, kernels {kernel_isa() or 'default'}, "
          f"{os.cpu_count()} CPUs, load {' '.join(f'{x:.2f}' for x in os.getloadavg())}, commit {commit()}")
    with tempfile.TemporaryDirectory() as tmp:
        if "A" in args.parts:
            if args.smoke:
                part_a(Path(smoke_model(Path(tmp))), Path(tmp), args)
            else:
                part_a(resolve_model_path(MODEL), cache_dir() / "hf-from-gguf", args)
        if "B" in args.parts:
            part_b(Path(tmp), args)


if __name__ == "__main__":
    main()
