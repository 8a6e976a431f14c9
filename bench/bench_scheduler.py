"""Scheduler overhead: median wall time of schedule() + update() per step with 256
running decodes and 1000 waiting requests (the queue must not cost per step).

    python bench/bench_scheduler.py [--policy sarathi] [--steps 2000]

Target: under 1 ms per step on a CPU core; prints the median and its ratio to 1 ms.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

from sarathi_rt.scheduler import (SchedulerConfig, available_policies, create_scheduler,
                                  get_policy)

TARGET_MS = 1.0


def build(policy: str, running: int, waiting: int, seed: int = 0):
    rng = random.Random(seed)
    # Unchunked policies prefill whole prompts, and request_level admits its whole batch
    # in one step: give them a budget that holds every running prompt at once.
    budget = 512 if get_policy(policy).chunked else running * 512
    cfg = SchedulerConfig(policy=policy, token_budget=budget, max_num_seqs=running,
                          block_size=16, num_blocks=64 * 1024)
    sched = create_scheduler(cfg)
    for i in range(running):
        sched.add_request(i, rng.randint(64, 512), 3000)
    while True:  # prefill them all, until a step is pure decode of every one
        plan = sched.schedule()
        sched.update(plan)
        if plan.num_decode_tokens == running and not plan.num_prefill_tokens:
            break
    # Queued behind a full batch (max_num_seqs reached): present every step, never admitted.
    for i in range(running, running + waiting):
        sched.add_request(i, rng.randint(64, 4096), 256)
    return sched


def measure(policy: str, steps: int, warmup: int) -> list[float]:
    sched = build(policy, running=256, waiting=1000)
    times = []
    for k in range(warmup + steps):
        t0 = time.perf_counter()
        plan = sched.schedule()
        sched.update(plan)
        dt = time.perf_counter() - t0
        if k >= warmup:
            assert plan.num_decode_tokens == 256 and sched.num_waiting == 1000
            times.append(dt * 1e3)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policy", choices=available_policies() + ["all"], default="all")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--smoke", action="store_true", help="a seconds-long run of the same code path (quick lane)")
    args = ap.parse_args()
    if args.smoke:
        args.steps, args.warmup = 10, 2
    policies = available_policies() if args.policy == "all" else [args.policy]
    print(f"schedule()+update(), 256 running decodes + 1000 waiting, {args.steps} steps "
          f"after {args.warmup} warm-up; target {TARGET_MS:.1f} ms/step")
    for policy in policies:
        times = sorted(measure(policy, args.steps, args.warmup))
        med = statistics.median(times)
        p90 = times[int(0.9 * len(times))]
        print(f"{policy:15s} median {med:.3f} ms  p90 {p90:.3f} ms  "
              f"median/target {med / TARGET_MS:.2f}x  ({'OK' if med < TARGET_MS else 'SLOW'})")


if __name__ == "__main__":
    main()
