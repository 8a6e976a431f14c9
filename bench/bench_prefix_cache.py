"""Prefix caching, on vs off in the same run.

1. The engine on the CPU (`cpu-small` preset, random weights): a burst of requests whose
   prompts are one of a few system prompts (the shared part, >= 80% of each prompt) plus a
   short user message. Reports TTFT P50/P99, generated tokens/s, the cache hit rate, and
   checks that greedy outputs (tokens and logprobs) are identical with the cache on and off.
2. The simulator (A100 Llama-3-8B profile, sarathi policy): capacity (QPS of conversations)
   under a 100 ms P99 TBT SLO on a multi-turn chat workload, with and without the cache.

    python bench/bench_prefix_cache.py [--num-requests 24] [--system-len 448] [--skip-sim]
"""
from __future__ import annotations

import argparse
import time

from sarathi_rt import LLM, SamplingParams
from sarathi_rt.sim.budget import choose_token_budget, cost_model_curve
from sarathi_rt.sim.capacity import SLO, find_capacity
from sarathi_rt.measure.metrics import summarize
from sarathi_rt.harness.replay import warm_up
from sarathi_rt.models import resolve_model
from sarathi_rt.scheduler import SchedulerConfig
from sarathi_rt.sim import VidurCostModel, simulate
from sarathi_rt.workloads import data_path, multi_turn_workload, system_prompt_workload


def run_engine(on: bool, workload, args) -> dict:
    llm = LLM(args.model, token_budget=args.token_budget, max_num_seqs=len(workload), num_kv_blocks=args.kv_blocks,
              enable_prefix_caching=on)
    engine = llm.engine
    warm_up(engine)
    first_step = engine.num_steps
    t0 = time.perf_counter()
    for r in workload:  # a burst: every request arrives now
        engine.add_request(r.request_id, list(r.prompt_token_ids), SamplingParams(
            temperature=0.0, max_tokens=r.num_decode_tokens, ignore_eos=True, logprobs=0), arrival_time=t0)
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    outs = [done[r.request_id] for r in workload]
    s = summarize([o.metrics for o in outs], engine.steps_since(first_step))
    return {"ttft_p50": s.ttft.p50, "ttft_p99": s.ttft.p99, "tokens_per_s": s.tokens_per_s,
            "hit_rate": s.prefix_cache_hit_rate, "duration": s.duration,
            "outputs": [(o.token_ids, o.logprobs) for o in outs]}


def engine_part(args) -> None:
    wl = system_prompt_workload(args.num_requests, 1.0, num_system_prompts=args.system_prompts,
                                system_len=args.system_len, user_range=(32, 64), decode_range=(16, 16),
                                vocab_size=resolve_model(args.model).config.vocab_size, seed=args.seed)
    shared = min(args.system_len / r.num_prompt_tokens for r in wl)
    print(f"engine, {args.model} on the CPU: {len(wl)} requests at once, {args.system_prompts} system prompts of "
          f"{args.system_len} tokens (>= {shared:.0%} of each prompt), 16 output tokens each")
    res = {on: run_engine(on, wl, args) for on in (False, True)}
    off, on = res[False], res[True]
    print(f"{'cache':>6} {'TTFT P50 s':>11} {'TTFT P99 s':>11} {'tokens/s':>9} {'hit rate':>9} {'time s':>7}")
    for name, r in (("off", off), ("on", on)):
        print(f"{name:>6} {r['ttft_p50']:11.3f} {r['ttft_p99']:11.3f} {r['tokens_per_s']:9.1f} "
              f"{r['hit_rate']:9.1%} {r['duration']:7.2f}")
    same = off["outputs"] == on["outputs"]
    print(f"TTFT P50 {off['ttft_p50'] / on['ttft_p50']:.2f}x lower, P99 {off['ttft_p99'] / on['ttft_p99']:.2f}x "
          f"lower, throughput {on['tokens_per_s'] / off['tokens_per_s']:.2f}x higher with the cache; "
          f"outputs (tokens and logprobs) identical: {same}")
    if not same:
        raise SystemExit("outputs differ with the cache on and off")


def sim_part(args) -> None:
    cost = VidurCostModel(data_path("a100_llama-3-8b_mlp.csv.gz"), num_layers=32)
    profile = cost_model_curve(cost, list(range(32, 4097, 32)))
    budget = choose_token_budget(profile, 0.1, 128).token_budget
    slo = SLO(0.1)
    print(f"\nsimulated A100 Llama-3-8B, sarathi, token budget {budget} (from the 100 ms SLO): "
          f"{args.conversations} conversations of {args.turns} turns (first prompt 512, +64..256 per turn, "
          f"answers 64..256)")
    caps = {}
    for on in (False, True):
        cfg = SchedulerConfig(policy="sarathi", token_budget=budget, max_num_seqs=128,
                              num_blocks=cost.kv_cache_blocks(), enable_prefix_caching=on)

        def run(qps: float, cfg=cfg):
            wl = multi_turn_workload(args.conversations, qps, turns=args.turns, first_len=512,
                                     user_range=(64, 256), decode_range=(64, 256), think_time=5.0, seed=args.seed)
            return simulate(wl, cfg, cost).summary()

        caps[on] = find_capacity(run, slo, policy="sarathi", qps_start=0.5, rel_tol=0.02, max_probes=args.max_probes)
        s = run(caps[on].max_qps)
        print(f"  cache {'on ' if on else 'off'}: capacity {caps[on].max_qps:.3f} conversations/s "
              f"({caps[on].max_qps * args.turns:.2f} requests/s); there P99 TBT {s.tbt.p99 * 1e3:.1f} ms, "
              f"TTFT P50 {s.ttft.p50:.3f} s, hit rate {s.prefix_cache_hit_rate:.1%}")
    print(f"  capacity {caps[True].max_qps / caps[False].max_qps:.2f}x with the cache")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="cpu-small", help="the engine part's model (a preset, file or directory)")
    p.add_argument("--num-requests", type=int, default=24)
    p.add_argument("--system-prompts", type=int, default=2)
    p.add_argument("--system-len", type=int, default=448)
    p.add_argument("--token-budget", type=int, default=256)
    p.add_argument("--kv-blocks", type=int, default=1024)
    p.add_argument("--conversations", type=int, default=200)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--max-probes", type=int, default=30, help="simulations per capacity search")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-engine", action="store_true")
    p.add_argument("--skip-sim", action="store_true")
    p.add_argument("--smoke", action="store_true", help="a seconds-long run of the same code path (quick lane)")
    args = p.parse_args()
    if args.smoke:
        args.model, args.num_requests, args.system_len = "tiny", 4, 64
        args.conversations, args.turns, args.max_probes = 20, 2, 4
    if not args.skip_engine:
        engine_part(args)
    if not args.skip_sim:
        sim_part(args)


if __name__ == "__main__":
    main()
