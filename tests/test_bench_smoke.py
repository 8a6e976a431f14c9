"""Every script in bench/ runs in smoke mode (`--smoke`: a tiny, seconds-long run of the
same code path), so a benchmark that breaks fails the quick lane instead of rotting
until someone next measures with it.

A new bench is found by name and must take --smoke (or be listed in NOT_BENCHES with
the reason). GPU-only benches say they skipped, or run their code on the CPU. Each run
is a fresh process in an empty directory (what a bench writes lands there) with an empty
model cache (a smoke run never downloads: the GGUF bench skips); two run at a time, as
the CI machine has two cores."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
NOT_BENCHES = {"device_summary.py": "formats the table of device_check.sh's JSON lines; measures nothing",
               "ab_pairs.py": "the A/B helper bench_attention.py, bench_cpu_kernels.py and bench_step_overhead.py "
                              "import; measures nothing"}
# What each smoke run must print: its result line, so a bench that exits 0 having
# measured nothing still fails. A bench not listed must print something.
EXPECT = {
    "bench_adaptive_budget.py": r"worst cell:",
    "bench_adaptive_budget_engine.py": r"adaptive step-time forecasts",
    "bench_attention.py": r"mixed speedup .*x",
    "bench_attention_cost.py": r"chunk_wide / chunk_narrow",
    "bench_attention_gpu.py": r"load efficiency",
    "bench_cpu_kernels.py": r"levels agree: worst difference \d+\.\d+ of two roundings",
    "bench_attention_plan.py": r"worst GPU-grid load efficiency \d\.\d+ \(target >= 0\.9\)(.|\n)*"
                               r"plan update host time: median \d+\.\d+ ms",
    "bench_bf16_accuracy.py": r"bf16 engine vs transformers bf16: \d+/\d+ identical(.|\n)*float32 greedy answers "
                              r"changed by the batch composition \(of 2, against all batched\): alone 0, reversed, "
                              r"64-token chunks 0(.|\n)*bf16 / float32 time",
    "bench_e2e_cpu.py": r"ratio: .*x",
    "bench_gemm_small.py": r"float32  \| lm_head  \|   17 \|(.|\n)*worst cell: today's path \d+\.\d+x",
    "bench_gemm_gpu.py": r"skipped, no CUDA device|M >= 256: median ratio",
    "bench_gguf_load.py": r"cached load vs transformers: \d+\.\d+x faster\n(.|\n)*greedy, 2 chat prompts, max 4 "
                          r"tokens: 2/2 identical to transformers",
    "bench_hf_backend.py": r"ratio transformers-backed / native: \d+\.\d+x wall(.|\n)*identical \(2 chats\): 2/2"
                           r"(.|\n)*ratio transformers-backed / transformers generate_batch: \d+\.\d+x wall(.|\n)*"
                           r"identical \(4 requests\): 4/4",
    "bench_import.py": r"sarathi_rt\.LLM +\d",
    "bench_llamacpp.py": r"ratio sarathi_rt / stand-in .*x \(target >= 1\.5x\)",
    "bench_linear_staircase.py": r"token budget for a .* TBT target",
    "bench_lm_head_cpu.py": r"float32 +\| +1 \| +\d+\.\d+ \| +\d+\.\d+ \|.*\| \d+\.\d+x\n(.|\n)*"
                            r"bfloat16 +\| +17 \|.*\| \d+\.\d+x",
    "bench_multi_turn.py": r"answers identical: True",
    "bench_pipeline.py": r"PP=4 median bubble sarathi / vllm",
    "bench_pipeline_capacity.py": r"PP=4 sarathi vs vllm",
    "bench_prefix_cache.py": r"identical: True(.|\n)*capacity .*x with the cache",
    "bench_qos.py": r"llama-2-7b / sharegpt .* capacity at >= 99% per class: FCFS (>=)?\d+(\.\d+)? QPS(.|\n)*"
                    r"engine \(4 requests per mix run\): capacity at >= 99% per class: FCFS (>=)?\d+(\.\d+)? QPS, "
                    r"deadline (>=)?\d+(\.\d+)? QPS(.|\n)*overload 2x FCFS capacity: chat violations FCFS \d+/\d+",
    "bench_roofline_cpu.py": r"decode x8 in bfloat16: .*% of the compute bound \(target >= 50%\)(.|\n)*load: before",
    "bench_scheduler.py": r"median/target",
    "bench_sim.py": r"simulator / scheduler = ",
    "bench_sim_fidelity.py": r"in target at the probed speed",
    "bench_spec.py": r"\n +1 \| +4 \|(.|\n)*greedy outputs identical: True\nat 1 request, per kind:(.|\n)* synthetic "
                     r"\| +4 \|(.|\n)* all \| +4 \|.*\nspeculative / plain tokens/s ratio: \d+\.\d+x at 1 ",
    "bench_spec_draft.py": r"greedy outputs identical: True\ntiny draft accepted per verification \(\d+ "
                           r"verifications\) 0: \d+(.|\n)*self-draft accepted .*acceptance (9\d|100)%",
    "bench_spec_sim.py": r"rule / fixed k where fixed k pays within the target: worst \d\.\d+x(.|\n)*"
                         r"acceptance 0\.8: .* QPS, \d+\.\d+x no speculation",
    "bench_spec_structured.py": r"skipped, xgrammar is not installed|greedy outputs identical: True\n"
                                r"structured speculative / plain tokens/s ratio: \d+\.\d+x at 1 ",
    "bench_startup.py": r"ready in .* s",
    "bench_step_overhead.py": r"ms/step wall",
    "bench_token_budget.py": r"rule \(smallest step within 1\.2x the best time per token\) picks \d+; the CPU default "
                             r"is 128",
    "bench_structured.py": r"skipped, xgrammar is not installed|\n +4 .* \d+\.\d+x ",
}
TIMEOUT_S = 180
Run = subprocess.CompletedProcess[str]
BENCHES = sorted(p.name for p in BENCH.glob("*.py") if p.name not in NOT_BENCHES)


@pytest.fixture(scope="module")
def smoke_runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Future[Run]]]:
    """Starts every bench's smoke run at once (two at a time); each test waits for its own."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MPLBACKEND": "Agg",
           "SARATHI_RT_CACHE": str(tmp_path_factory.mktemp("model_cache"))}

    def run(name: str) -> Run:
        cwd = tmp_path_factory.mktemp(name.removesuffix(".py"))
        try:
            return subprocess.run([sys.executable, str(BENCH / name), "--smoke"], cwd=cwd, env=env,
                                  capture_output=True, text=True, timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired as e:
            return subprocess.CompletedProcess(e.cmd, -1, "", f"timed out after {TIMEOUT_S} s")

    pool = ThreadPoolExecutor(max_workers=2)
    yield {name: pool.submit(run, name) for name in BENCHES}
    pool.shutdown(cancel_futures=True)


def test_every_bench_takes_smoke() -> None:
    missing = [name for name in BENCHES if "--smoke" not in (BENCH / name).read_text()]
    assert not missing, f"these bench scripts take no --smoke (add one, or list them in NOT_BENCHES): {missing}"
    unchecked = [name for name in BENCHES if name not in EXPECT]
    assert not unchecked, f"these benches' smoke runs check no figure (add a pattern to EXPECT): {unchecked}"


@pytest.mark.parametrize("name", BENCHES)
def test_bench_smoke(name: str, smoke_runs: dict[str, Future[Run]]) -> None:
    res = smoke_runs[name].result()
    log = f"--- stdout\n{res.stdout[-3000:]}\n--- stderr\n{res.stderr[-3000:]}"
    assert res.returncode == 0, f"{name} --smoke exited {res.returncode}\n{log}"
    assert res.stdout.strip(), f"{name} --smoke printed nothing\n{log}"
    assert re.search(EXPECT[name], res.stdout), f"{name} --smoke did not print /{EXPECT[name]}/\n{log}"


def test_spec_prompts_are_counted_under_smollm2s_chat_template() -> None:
    """bench/data/spec_prompts.json states each prompt's kind and its length under
    SmolLM2's chat template (bench_spec.py sizes its KV cache by them): at least 8 prompts
    of each of the four kinds issue 40 names, each 200-600 tokens, every count exact. Skips
    where the model is not cached (the quick lane never downloads it)."""
    from sarathi_rt.models.hub import NAMED_MODELS, cache_dir, named_model_path
    from sarathi_rt.text.tokenizer import Tokenizer

    data = json.loads((BENCH / "data" / "spec_prompts.json").read_text())
    kinds = [p["kind"] for p in data["prompts"]]
    assert {k: kinds.count(k) for k in set(kinds)} == {k: max(8, kinds.count(k))
                                                      for k in ("summarize", "edit", "code", "qa")}
    assert all(200 <= p["tokens"] <= 600 for p in data["prompts"])
    model = "smollm2-135m-instruct"
    if not (cache_dir() / model / Path(NAMED_MODELS[model].member).name).is_file():
        pytest.skip(f"{model} is not in the model cache {cache_dir()}")
    tokenizer = Tokenizer.from_gguf(named_model_path(model))
    counted = [len(tokenizer.apply_chat_template([{"role": "user", "content": p["text"]}], add_generation_prompt=True))
               for p in data["prompts"]]
    assert counted == [p["tokens"] for p in data["prompts"]]


def test_adaptive_budget_reuses_statics_only_when_they_reproduce(tmp_path: Path) -> None:
    """`--static-from` takes a previous run's static capacities and reruns the default rule
    and each cell's best static budget; a file whose best static no longer reproduces
    (the static policies changed) stops the run instead of mixing two code versions."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    script = [sys.executable, str(BENCH / "bench_adaptive_budget.py"), "--smoke", "--jobs", "2"]

    def run(*args: str) -> Run:
        return subprocess.run([*script, *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=TIMEOUT_S)

    bad = run("--traces", "sharegpt,nope")
    assert bad.returncode != 0 and "--traces: no shipped trace 'nope'" in bad.stderr
    first = run("--out", "first")
    assert first.returncode == 0, first.stderr
    saved = tmp_path / "first" / "capacity.json"
    again = run("--out", "again", "--static-from", str(saved))
    assert again.returncode == 0, again.stderr
    assert "2 searches" in again.stdout  # the default rule and the best static, nothing else
    worst = [line for line in first.stdout.splitlines() if line.startswith("worst cell:")][0]
    assert worst.split(" (")[0] in again.stdout

    data = json.loads(saved.read_text())
    cell = data["cells"][0]
    cell["brackets"][str(cell["best_budget"])][0] *= 2
    saved.write_text(json.dumps(data))
    tampered = run("--out", "tampered", "--static-from", str(saved))
    assert tampered.returncode != 0 and "static policies changed" in tampered.stderr
