"""Pipeline bubbles in simulation: sarathi against vllm at PP = 1, 2, 4 on the A100
Llama-2-7B profile with ShareGPT requests. Each pipeline degree runs at `--qps x PP`
(PP GPUs hold PP times the KV cache), and the same requests go to both policies.

Reports per policy: median and P99 bubble time per request (time its micro-batches
waited between stages for a busy stage), mean stage idle fraction, P99 TBT, and the
sarathi / vllm ratio of median bubbles.

    python bench/bench_pipeline.py [--num-requests 1000] [--qps 0.8] [--token-budget 512]
"""
from __future__ import annotations

import argparse

from sarathi_rt.measure.metrics import percentile
from sarathi_rt.scheduler import SchedulerConfig
from sarathi_rt.sim import VidurCostModel, simulate
from sarathi_rt.workloads import WorkloadConfig, data_path, make_workload


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-requests", type=int, default=1000)
    p.add_argument("--qps", type=float, default=0.8, help="load per pipeline stage")
    p.add_argument("--token-budget", type=int, default=512)
    p.add_argument("--smoke", action="store_true", help="a seconds-long run of the same code path (quick lane)")
    args = p.parse_args()
    if args.smoke:
        args.num_requests = 40
    cost = VidurCostModel(data_path("a100_llama-2-7b_mlp.csv.gz"))
    for pp in (1, 2, 4):
        workload = make_workload(WorkloadConfig(num_requests=args.num_requests, qps=args.qps * pp, seed=0))
        blocks = cost.kv_cache_blocks(pipeline_stages=pp)
        longest = max(r.num_prompt_tokens + r.num_decode_tokens for r in workload)
        medians = {}
        for policy, budget in (("sarathi", args.token_budget), ("vllm", longest)):
            # One partial prompt per micro-batch in flight keeps every stage fed.
            config = SchedulerConfig(policy=policy, token_budget=budget, max_num_seqs=128 * pp, num_blocks=blocks,
                                     max_partial_prefills=pp)
            res = simulate(workload, config, cost, pipeline_stages=pp)
            s = res.summary()
            medians[policy] = percentile(res.bubble_times, 50)
            idle = sum(res.stage_idle) / (pp * res.makespan)
            print(f"PP={pp} {policy:>8} @ {args.qps * pp:.2f} QPS: bubble/request P50 {medians[policy]:7.3f} s, "
                  f"P99 {percentile(res.bubble_times, 99):7.3f} s; stage idle {idle:5.1%}; "
                  f"P99 TBT {s.tbt.p99 * 1e3:6.1f} ms; P50 sched delay {s.sched_delay.p50:6.2f} s")
        if pp > 1 and medians["vllm"] > 0:
            print(f"PP={pp} median bubble sarathi / vllm = {medians['sarathi'] / medians['vllm']:.3f}")


if __name__ == "__main__":
    main()
