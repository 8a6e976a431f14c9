"""Simulator speed: wall time to simulate N ShareGPT requests on the A100 Llama-2-7B
profile, against a baseline measured in the same run: the bare scheduler loop (same
plans, schedule + update only, no cost model, no metrics).

    python bench/bench_sim.py [--num-requests 10000] [--qps 1.0] [--repeats 3]
"""
from __future__ import annotations

import argparse
import statistics
import time

from sarathi_rt.scheduler import SchedulerConfig, create_scheduler
from sarathi_rt.sim import VidurCostModel, simulate
from sarathi_rt.workloads import WorkloadConfig, data_path, make_workload


def bare_scheduler(workload, config: SchedulerConfig, step_times: list[float]) -> None:
    """Replays the simulator's step times, so the scheduler sees the same arrivals."""
    sched = create_scheduler(config)
    now, nxt, i = 0.0, 0, 0
    while nxt < len(workload) or sched.has_unfinished():
        while nxt < len(workload) and workload[nxt].arrival_time <= now:
            r = workload[nxt]
            sched.add_request(r.request_id, r.num_prompt_tokens, r.num_decode_tokens)
            nxt += 1
        plan = sched.schedule()
        sched.update(plan)
        if plan.is_empty:
            now = workload[nxt].arrival_time if nxt < len(workload) else now
        else:
            now += step_times[i] if i < len(step_times) else 0.0
            i += 1


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-requests", type=int, default=10000)
    p.add_argument("--qps", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--smoke", action="store_true", help="a seconds-long run of the same code path (quick lane)")
    args = p.parse_args()
    if args.smoke:
        args.num_requests, args.repeats = 100, 1
    cost = VidurCostModel(data_path("a100_llama-2-7b_mlp.csv.gz"))
    workload = make_workload(WorkloadConfig(num_requests=args.num_requests, qps=args.qps, seed=0))
    tokens = sum(r.num_prompt_tokens + r.num_decode_tokens for r in workload)
    print(f"{len(workload)} ShareGPT requests ({tokens / 1e6:.1f}M tokens) at {args.qps} QPS, "
          f"median of {args.repeats}")
    for policy, budget in (("sarathi", 512), ("vllm", 8192)):
        config = SchedulerConfig(policy=policy, token_budget=budget, max_num_seqs=128,
                                 num_blocks=cost.kv_cache_blocks())
        sim_s, base_s, steps = [], [], 0
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            res = simulate(workload, config, cost)
            sim_s.append(time.perf_counter() - t0)
            steps = len(res.steps)
            durations = [s.duration for s in res.steps]
            t0 = time.perf_counter()
            bare_scheduler(workload, config, durations)
            base_s.append(time.perf_counter() - t0)
        sim, base = statistics.median(sim_s), statistics.median(base_s)
        print(f"{policy:>8}: simulate {sim:6.2f} s ({len(workload) / sim:7.0f} req/s, {steps / sim:7.0f} steps/s); "
              f"bare scheduler {base:6.2f} s; simulator / scheduler = {sim / base:.2f}x")


if __name__ == "__main__":
    main()
