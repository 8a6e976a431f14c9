"""How accurate the bfloat16 engine is: greedy against transformers in bfloat16 on the same
weights, and its logprobs against the float32 engine.

    python bench/bench_bf16_accuracy.py [--max-tokens 32] [--repeats 3]

The 16-chat SmolLM2 set (tests/smollm2_chats.py) on SmolLM2-135M-Instruct (the Q4_1
GGUF, from the cache). Three figures:

1. Token for token: the bf16 engine's greedy answers against transformers' greedy
   `generate` in bfloat16 on the same weights (its GGUF load in float32, cast to bf16 as
   our loader casts: the embeddings are checked equal). Prints how many of the 16 are
   identical and, for the others, the first position where they part; then how many of
   each bf16 side's answers equal float32 greedy. The two bf16 sides round in different
   places (transformers rotates with cos/sin rounded to bf16 and rounds SiLU's output
   before the product with up; the engine's fused kernels compute each in float32 and
   round once), so a near-tie can go either way on either side.
2. Logprobs, teacher-forced: the bf16 engine's greedy tokens are scored by the float32
   engine on the same prefixes (prompt_logprobs over prompt + answer), and by the bf16
   engine the same way; the figure is the mean |logprob_bf16 - logprob_fp32| over every
   answer token. The same on the same tokens for transformers bf16 vs transformers
   float32 is the yardstick: what bf16 itself costs, in a reference implementation.
3. Speed: the bf16 and float32 engines' generate on the 16 chats, interleaved, median of
   `--repeats`; on a CPU without native BF16 (avx512_bf16, amx_bf16) bf16 is emulated.
4. Batch composition: each dtype's greedy answers with every chat alone, and batched in
   reverse order with 64-token chunks, against the 16 batched as they come: how many
   answers change with the batch around them (a GEMM's row sums round differently with
   the number of rows; float32 rounds too finely for it to show in the argmax).

On a CPU without native BF16 the engine computes in float32 unless forced: this script
sets SARATHI_RT_CPU_BF16=emulate, so "bf16" is bf16 on any CPU. `--smoke` runs the same
code on the `tiny` preset's shape with random weights saved by transformers (no download).
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ["SARATHI_RT_CPU_BF16"] = "emulate"  # measure bf16 even where it is emulated

import torch  # noqa: E402

from sarathi_rt import LLM, SamplingParams  # noqa: E402
from sarathi_rt.utils.cpu import cpu_flags, missing_bf16  # noqa: E402

MODEL = "smollm2-135m-instruct"


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where a and b differ (the shorter one's length if one is a
    prefix of the other), None when they are equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def engine_generate(llm: LLM, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], float]:
    start = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
    return [o.token_ids for o in outs], time.perf_counter() - start


def composition_changes(llm: LLM, chunked: LLM, prompts: list[list[int]], max_tokens: int,
                        batched: list[list[int]]) -> dict[str, int]:
    """How many of `batched` (the prompts' greedy answers, all in one batch on `llm`)
    change with each prompt alone, and with the batch reversed on `chunked` (64-token chunks)."""
    alone = [engine_generate(llm, [p], max_tokens)[0][0] for p in prompts]
    reversed_ = engine_generate(chunked, prompts[::-1], max_tokens)[0][::-1]
    return {"alone": sum(a != b for a, b in zip(alone, batched)),
            "reversed, 64-token chunks": sum(a != b for a, b in zip(reversed_, batched))}


def engine_scores(llm: LLM, prompts: list[list[int]], answers: list[list[int]]) -> list[list[float]]:
    """Each answer token's logprob under `llm`, teacher-forced on prompt + answer."""
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    outs = llm.generate([p + a for p, a in zip(prompts, answers)], params, use_tqdm=False)
    return [[lp.logprob for lp in o.prompt_logprobs[len(p):]] for p, o in zip(prompts, outs)]


@torch.no_grad()
def hf_generate(model: torch.nn.Module, prompt: list[int], max_tokens: int, eos: list[int]) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False,
                         eos_token_id=eos, pad_token_id=eos[0])
    return out[0, len(prompt):].tolist()


@torch.no_grad()
def hf_scores(model: torch.nn.Module, prompt: list[int], answer: list[int]) -> list[float]:
    logits = model(torch.tensor([prompt + answer])).logits[0, len(prompt) - 1:-1].double()
    return logits.log_softmax(dim=1).gather(1, torch.tensor(answer).unsqueeze(1)).squeeze(1).tolist()


def mean_abs_diff(a: list[list[float]], b: list[list[float]]) -> tuple[float, float]:
    """(mean, max) of |a - b| over every position of every row."""
    diffs = [abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb)]
    return statistics.fmean(diffs), max(diffs)


def real_model() -> tuple[str, torch.nn.Module, list[list[int]], list[int]]:
    """SmolLM2 from the cache: (model, transformers float32, the 16 chats' prompt ids, eos ids)."""
    from transformers import AutoModelForCausalLM

    from sarathi_rt.models import resolve_model_path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from smollm2_chats import CONVERSATIONS

    path = resolve_model_path(MODEL)
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    with LLM(MODEL, dtype="float32", num_kv_blocks=8) as llm:
        prompts = [llm.tokenizer.apply_chat_template(c) for c in CONVERSATIONS]
    eos = hf.generation_config.eos_token_id
    return MODEL, hf, prompts, eos if isinstance(eos, list) else [eos]


def smoke_model(root: Path) -> tuple[str, torch.nn.Module, list[list[int]], list[int]]:
    """The tiny preset's shape with random weights, saved by transformers; 2 prompts."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from sarathi_rt.models import PRESETS

    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(**PRESETS["tiny"].to_hf_dict())).float().eval()
    hf.save_pretrained(root)
    return str(root), hf, [[5, 9, 200, 31], list(range(40, 57))], [2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3, help="timed generate rounds per dtype (interleaved)")
    ap.add_argument("--smoke", action="store_true", help="seconds-long run on random tiny weights (quick lane)")
    args = ap.parse_args()
    if args.max_tokens < 1 or args.repeats < 1:
        raise SystemExit("--max-tokens and --repeats must be >= 1")
    if args.smoke:
        args.max_tokens, args.repeats = 4, 1
    with tempfile.TemporaryDirectory() as tmp:
        model, hf32, prompts, eos = smoke_model(Path(tmp)) if args.smoke else real_model()
        options = dict(num_kv_blocks=256, max_num_seqs=len(prompts), token_budget=512)
        engines = {dt: LLM(model, dtype=dt, **options) for dt in ("bfloat16", "float32")}
        chunked = {dt: LLM(model, dtype=dt, **{**options, "chunk_size": 64, "token_budget": 64 + len(prompts)})
                   for dt in engines}
    hf16 = copy.deepcopy(hf32).to(torch.bfloat16)
    ours16 = engines["bfloat16"].engine.executor.worker.model
    assert ours16.dtype is torch.bfloat16 and torch.equal(ours16.embed_tokens, hf16.get_input_embeddings().weight), \
        "the bf16 engine and transformers bf16 must hold the same weights"
    missing = missing_bf16(cpu_flags())
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), load {os.getloadavg()[0]:.2f}; "
          f"{MODEL if not args.smoke else 'tiny (random weights)'}; {len(prompts)} prompts, greedy, at most "
          f"{args.max_tokens} tokens; bf16 "
          + (f"EMULATED (the CPU lacks {' and '.join(missing)})" if missing else "native"))

    seconds: dict[str, list[float]] = {"bfloat16": [], "float32": []}
    for r in range(args.repeats):  # alternate which dtype goes first
        for dt in (("bfloat16", "float32") if r % 2 == 0 else ("float32", "bfloat16")):
            answers, s = engine_generate(engines[dt], prompts, args.max_tokens)
            seconds[dt].append(s)
            if dt == "bfloat16":
                ours = answers
            else:
                ours32 = answers
    theirs = [hf_generate(hf16, p, args.max_tokens, eos) for p in prompts]
    parts = [first_difference(a, b) for a, b in zip(ours, theirs)]
    same = sum(d is None for d in parts)
    print(f"token for token, bf16 engine vs transformers bf16: {same}/{len(prompts)} identical"
          + ("" if same == len(prompts) else "; the others part at token "
             + ", ".join(f"{d} (chat {i})" for i, d in enumerate(parts) if d is not None)))
    same32 = sum(a == b for a, b in zip(ours, ours32))
    theirs32 = sum(a == b for a, b in zip(theirs, ours32))
    print(f"  against the float32 engine's greedy answers: bf16 engine {same32}/{len(prompts)} identical, "
          f"transformers bf16 {theirs32}/{len(prompts)}")

    scored = [a for a in ours if a]
    kept = [p for p, a in zip(prompts, ours) if a]
    ours_lp = {dt: engine_scores(engines[dt], kept, scored) for dt in engines}
    hf_lp = {name: [hf_scores(m, p, a) for p, a in zip(kept, scored)] for name, m in (("bf16", hf16), ("fp32", hf32))}
    tokens = sum(map(len, scored))
    ours_mean, ours_max = mean_abs_diff(ours_lp["bfloat16"], ours_lp["float32"])
    ref_mean, ref_max = mean_abs_diff(hf_lp["bf16"], hf_lp["fp32"])
    cross_mean, _ = mean_abs_diff(ours_lp["bfloat16"], hf_lp["bf16"])
    check_mean, _ = mean_abs_diff(ours_lp["float32"], hf_lp["fp32"])
    print(f"teacher-forced on the bf16 engine's {tokens} answer tokens, mean |logprob bf16 - logprob fp32|:")
    print(f"  bf16 engine vs float32 engine:        {ours_mean:.4f} (max {ours_max:.3f})")
    print(f"  transformers bf16 vs float32 (yardstick): {ref_mean:.4f} (max {ref_max:.3f})")
    print(f"  bf16 engine vs transformers bf16: {cross_mean:.4f}; float32 engine vs transformers float32: "
          f"{check_mean:.2e}")

    batched = {"bfloat16": ours, "float32": ours32}
    for dt, llm in engines.items():
        changed = composition_changes(llm, chunked[dt], prompts, args.max_tokens, batched[dt])
        print(f"{dt} greedy answers changed by the batch composition (of {len(prompts)}, against all batched): "
              + ", ".join(f"{name} {n}" for name, n in changed.items()))

    med = {dt: statistics.median(s) for dt, s in seconds.items()}
    print(f"generate, {len(prompts)} prompts batched: bf16 {med['bfloat16']:.2f} s, float32 {med['float32']:.2f} s (median of "
          f"{args.repeats}); bf16 / float32 time: {med['bfloat16'] / med['float32']:.2f}x")
    for llm in (*engines.values(), *chunked.values()):
        llm.shutdown()


if __name__ == "__main__":
    main()
