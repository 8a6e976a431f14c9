"""Multi-turn chat with prefix caching on vs off: TTFT per turn.

Each conversation is 8 turns on the real model (SmolLM2-135M-Instruct on the CPU,
greedy): every turn renders the whole conversation with the chat template, the
previous answers re-sent as text, as an OpenAI client does. With the cache, the blocks
of the previous prompt and of the answer generated from it (keyed as they filled) are
found again, so a turn prefills only its new user message. Prints per turn: prompt
tokens, tokens served from the cache, TTFT without and with, and whether every answer
is identical with the cache on and off.

    python bench/bench_multi_turn.py [--conversations 2] [--turns 8] [--max-tokens 64]
    python bench/bench_multi_turn.py --smoke   # `tiny` (random weights, token ids), 3 turns
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

from sarathi_rt import LLM, SamplingParams
from sarathi_rt.harness.replay import warm_up

TOPICS = [
    ["I want to bake bread at home. Where do I start?", "What flour should I buy?", "How long should it rise?",
     "My dough is too sticky. What now?", "How hot should the oven be?", "How do I know it is done?",
     "Can I freeze the loaf?", "Give me a one-line summary of all this."],
    ["Tell me about the planet Mars.", "How far away is it?", "Could people live there?",
     "What would they eat?", "How long is a day there?", "What is its weather like?",
     "Which rovers are there now?", "Sum up our chat in one sentence."],
]


class Conversation:
    """The turns of one conversation: the chat template over text messages when the
    model has one, else token ids (a random user message per turn after the answer)."""

    def __init__(self, llm: LLM, index: int, rng: random.Random) -> None:
        self.llm, self.index, self.rng = llm, index, rng
        self.messages: list[dict[str, str]] = []
        self.ids: list[int] = []

    def prompt(self, turn: int) -> list[int]:
        tokenizer = self.llm.tokenizer
        if tokenizer is not None and tokenizer.chat_template is not None:
            question = TOPICS[self.index % len(TOPICS)][turn % len(TOPICS[0])]
            self.messages.append({"role": "user", "content": question})
            return list(tokenizer.apply_chat_template(self.messages))
        self.ids += [self.rng.randrange(3, 500) for _ in range(24)]
        return list(self.ids)

    def answered(self, text: str | None, token_ids: list[int]) -> None:
        if self.messages:
            self.messages.append({"role": "assistant", "content": text or ""})
        else:
            self.ids += token_ids


def run(on: bool, args: argparse.Namespace) -> list[list[tuple[int, int, float, list[int]]]]:
    """Per turn, per conversation: (prompt tokens, cached tokens, TTFT s, answer ids)."""
    llm = LLM(args.model, enable_prefix_caching=on, token_budget=args.token_budget, max_num_seqs=8,
              num_kv_blocks=args.kv_blocks, seed=0)
    engine = llm.engine
    warm_up(engine)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=llm.tokenizer is None)
    convs = [Conversation(llm, i, random.Random(i)) for i in range(args.conversations)]
    turns = []
    for turn in range(args.turns):
        now = time.perf_counter()  # the conversations' next messages arrive together
        for i, conv in enumerate(convs):
            engine.add_request(i, conv.prompt(turn), params, arrival_time=now)
        done = {}
        while engine.has_unfinished():
            done |= {o.request_id: o for o in engine.step() if o.finished}
        row = []
        for i, conv in enumerate(convs):
            out = done[i]
            conv.answered(out.text, out.token_ids)
            row.append((out.metrics.num_prompt_tokens, out.num_cached_tokens, out.metrics.ttft, out.token_ids))
        turns.append(row)
    llm.shutdown()
    return turns


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--conversations", type=int, default=2)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--token-budget", type=int, default=512)
    p.add_argument("--kv-blocks", type=int, default=1024)
    p.add_argument("--smoke", action="store_true", help="tiny model, 3 turns of 8 tokens")
    args = p.parse_args()
    if args.smoke:
        args.model, args.turns, args.max_tokens, args.kv_blocks = "tiny", 3, 8, 256
    off, on = run(False, args), run(True, args)
    same = all(a[3] == b[3] for x, y in zip(off, on) for a, b in zip(x, y))
    print(f"{args.model} on the CPU: {args.conversations} conversations x {args.turns} turns, at most "
          f"{args.max_tokens} tokens per answer, greedy; mean over the conversations")
    print(f"{'turn':>4} {'prompt':>7} {'cached':>7} {'TTFT off ms':>12} {'TTFT on ms':>11} {'speedup':>8}")
    for turn, (x, y) in enumerate(zip(off, on), 1):
        t_off, t_on = statistics.mean(r[2] for r in x), statistics.mean(r[2] for r in y)
        print(f"{turn:>4} {statistics.mean(r[0] for r in y):>7.0f} {statistics.mean(r[1] for r in y):>7.0f} "
              f"{t_off * 1e3:>12.1f} {t_on * 1e3:>11.1f} {t_off / t_on:>7.2f}x")
    late_off = sum(r[2] for x in off[1:] for r in x)
    late_on = sum(r[2] for x in on[1:] for r in x)
    print(f"turns 2-{args.turns}: total TTFT {late_off:.2f} s off, {late_on:.2f} s on ({late_off / late_on:.2f}x); "
          f"answers identical: {same}")


if __name__ == "__main__":
    main()
