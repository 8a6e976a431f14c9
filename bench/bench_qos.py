"""QoS classes with deadlines: one deployment serving interactive (chat) and batch
traffic, deadline-aware (qos_policy "deadline") against the same scheduler run FCFS
(qos_policy "fcfs"), and against siloed replicas (one class each).

    python bench/bench_qos.py [--requests 200] [--no-engine | --no-sim] [--smoke]

Simulator, on the shipped A100 profiles (Llama-2-7B, Llama-3-8B) and two traces
(ShareGPT, arXiv summarisation), sarathi with token budget 512, a 35% chat / 65% batch
mix (Poisson arrivals, seeded):
1. capacity (the highest QPS at which every class has >= 99% of its requests meeting
   every deadline), deadline vs FCFS (target >= 1.2x);
2. shared vs siloed on equal hardware: two replicas each serving half the mix with QoS,
   against two replicas each serving one class with the better of FCFS and deadline-aware
   for it (capacity = the rate at which the weaker silo saturates) (target >= 1.25x);
3. overload at 1.5x and 2x the FCFS capacity: the chat class's deadline violations
   (target >= 10x fewer than FCFS) and the total goodput (target: not lower).
Then the real engine on the CPU (SmolLM2-135M-Instruct, ShareGPT lengths / 16 and the
token budget with them; the classes scaled to a full step measured before each rate: the
chat tbt is CPU_TBT_STEPS full steps, every other deadline in the same ratio as above):
the same three comparisons on a ladder of rates, side by side in one process: at each
rate the mix FCFS and deadline-aware on one engine (a replica of a shared pair), and the
two silos (a chat-only and a batch-only engine, deadline-aware, at their shares of the
pair's load, with their shares of its requests), with the load average beside it.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import time

from sarathi_rt.measure.metrics import MetricsSummary
from sarathi_rt.scheduler import QoSClass, SchedulerConfig
from sarathi_rt.sim import VidurCostModel, simulate
from sarathi_rt.sim.capacity import AttainmentSLO, simulated_capacity
from sarathi_rt.workloads import WorkloadConfig, data_path, make_workload

PROFILES = {"llama-2-7b": "a100_llama-2-7b_mlp.csv.gz", "llama-3-8b": "a100_llama-3-8b_mlp.csv.gz"}
TRACES = ("sharegpt", "arxiv")
CLASSES = {"chat": QoSClass(ttft=2.0, tbt=0.1, priority=1), "batch": QoSClass(ttft=30.0, tbt=0.5)}
MIX = {"chat": 0.35, "batch": 0.65}
TIGHT = "chat"
# The engine's classes are these scaled to the CPU (cpu_classes): the chat class's tbt
# becomes CPU_TBT_STEPS full steps (the token budget, scaled with the prompts) measured
# on the engine, every other deadline keeps its ratio to it. On an A100 a full
# 512-token Llama-2-7B step takes 50-70 ms, so the chat tbt of 0.1 s is about 2 full
# steps there too.
CPU_TBT_STEPS = 2.0
ATTAINMENT = 0.99
SIM_TOKEN_BUDGET = 512


@dataclasses.dataclass
class Cell:
    """One (profile, trace): capacities in QPS and the overload runs."""

    fcfs: float
    deadline: float
    silo_chat: float  # chat-only replica
    silo_batch: float  # batch-only replica
    overload: dict[float, tuple[MetricsSummary, MetricsSummary]]  # factor -> (fcfs, deadline)

    @property
    def siloed(self) -> float:
        """Total rate two silos carry: each class's share saturates its own replica."""
        return min(self.silo_chat / MIX["chat"], self.silo_batch / MIX["batch"])


def sched_config(num_blocks: int, qos_policy: str = "deadline") -> SchedulerConfig:
    return SchedulerConfig(token_budget=SIM_TOKEN_BUDGET, max_num_seqs=128, num_blocks=num_blocks, qos_classes=CLASSES,
                           qos_policy=qos_policy)


def violations(s: MetricsSummary, name: str = TIGHT) -> int:
    q = s.qos[name]
    return round(q.num_requests * (1 - q.attainment))


def goodput(s: MetricsSummary) -> float:
    return sum(q.goodput for q in s.qos.values() if q.num_requests)


def sim_cell(profile: str, trace: str, n: int, probes: int) -> Cell:
    cost = VidurCostModel(data_path(PROFILES[profile]))
    blocks = cost.kv_cache_blocks()
    work = WorkloadConfig(num_requests=n, lengths=trace, qos_mix=MIX, seed=0)
    slo = AttainmentSLO(ATTAINMENT)

    def cap(mix: dict[str, float], qos_policy: str) -> float:
        return simulated_capacity(dataclasses.replace(work, qos_mix=mix), sched_config(blocks, qos_policy), cost,
                                  slo, qps_start=1.0, rel_tol=0.04, max_probes=probes).max_qps

    fcfs, deadline = cap(MIX, "fcfs"), cap(MIX, "deadline")
    overload = {}
    for factor in (1.5, 2.0):
        reqs = make_workload(dataclasses.replace(work, qps=factor * fcfs))
        overload[factor] = tuple(simulate(reqs, sched_config(blocks, p), cost).summary() for p in ("fcfs", "deadline"))
    # Each silo gets the better of the two policies: a fair siloed baseline is the best
    # each dedicated replica can do (one class alone can still gain from deadline sizing).
    silo_chat, silo_batch = (max(cap({name: 1.0}, p) for p in ("fcfs", "deadline")) for name in ("chat", "batch"))
    return Cell(fcfs, deadline, silo_chat, silo_batch, overload)  # type: ignore[arg-type]


def print_cell(name: str, c: Cell) -> None:
    print(f"{name}: capacity at >= {ATTAINMENT:.0%} per class: FCFS {c.fcfs:.3g} QPS, deadline {c.deadline:.3g} QPS "
          f"-> {c.deadline / c.fcfs:.2f}x (target >= 1.2x)")
    print(f"  shared vs siloed, two replicas: shared {2 * c.deadline:.3g} QPS, siloed {c.siloed:.3g} QPS "
          f"(chat silo {c.silo_chat:.3g}, batch silo {c.silo_batch:.3g}) -> {2 * c.deadline / c.siloed:.2f}x "
          f"(target >= 1.25x)")
    for factor, (f, d) in c.overload.items():
        vf, vd = violations(f), violations(d)
        ratio = f"{vf / vd:.1f}x" if vd else ("inf" if vf else "n/a (none)")
        print(f"  overload {factor:g}x FCFS capacity: {TIGHT} violations FCFS {vf}/{f.qos[TIGHT].num_requests}, "
              f"deadline {vd} ({d.qos[TIGHT].relegated} relegated) -> {ratio} fewer (target >= 10x); "
              f"goodput {goodput(f):.3g} vs {goodput(d):.3g} req/s")


# --------------------------------------------------------------------- engine
def cpu_classes(full_step: float) -> dict[str, QoSClass]:
    """CLASSES scaled so the chat tbt is CPU_TBT_STEPS steps of `full_step` seconds."""
    scale = CPU_TBT_STEPS * full_step / CLASSES[TIGHT].tbt
    return {k: dataclasses.replace(c, ttft=c.ttft * scale, tbt=c.tbt * scale) for k, c in CLASSES.items()}


def full_step_seconds(engine, tokens: int, repeats: int = 3) -> float:
    """Median seconds of a step that prefills `tokens` prompt tokens (a full step)."""
    from sarathi_rt.sampling import SamplingParams

    times = []
    for i in range(repeats):
        engine.add_request(f"__full_step_{i}__", [3 + (i + j) % 500 for j in range(tokens)],
                           SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
        start = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def engine_runs(model: str, n: int, rates: list[float], length_scale: float) -> None:
    """Side by side in one process, at each rate of the ladder: the mix on one engine
    (a replica of a shared pair), FCFS then deadline-aware; and the two silos (a
    chat-only and a batch-only engine at their shares of the pair's rate, deadline-aware:
    the better policy for a silo in every simulated cell). Before each rate a full step
    is measured and the classes scaled to it (cpu_classes), so that the deadlines follow
    the shared machine's speed; the chat misses and goodput at the higher rates are the
    overload comparison."""
    from sarathi_rt.engine import EngineConfig, LLMEngine
    from sarathi_rt.measure.metrics import summarize
    from sarathi_rt.measure.replay import replay, warm_up

    # The simulator's token budget scaled with the prompt lengths (at least 32 tokens),
    # so a chunk is the same share of a prompt; half of it may be decodes.
    budget = max(32, round(SIM_TOKEN_BUDGET * length_scale))
    seqs = budget // 2
    plain = LLMEngine(EngineConfig(model=model, token_budget=budget, max_num_seqs=seqs, num_kv_blocks=512))
    executor = plain.executor
    warm_up(plain)

    def run(rate: float, mix: dict[str, float], qos_policy: str, num_requests: int,
            classes: dict[str, QoSClass]) -> MetricsSummary:
        config = EngineConfig(model=model, token_budget=budget, max_num_seqs=seqs, num_kv_blocks=512,
                              qos_classes=classes, qos_policy=qos_policy)
        engine = LLMEngine(config, executor=executor)
        warm_up(engine)
        work = make_workload(WorkloadConfig(num_requests=num_requests, qps=rate, lengths="sharegpt",
                                            length_scale=length_scale,
                                            max_total_tokens=2048, qos_mix=mix, seed=1))
        return summarize(*replay(engine, work), qos_classes=classes)

    print(f"engine: {model} on the CPU, {n} requests per run, ShareGPT x{length_scale:g}, token budget {budget}; "
          f"classes scaled to a full {budget}-token step measured before each rate (chat tbt = "
          f"{CPU_TBT_STEPS:g} steps, chat ttft {CLASSES[TIGHT].ttft / CLASSES[TIGHT].tbt:g} x its tbt)")
    print("  QPS  | step ms (load) | FCFS chat/batch attained | deadline chat/batch (relegated) | silos chat/batch | "
          f"{TIGHT} misses F/D | goodput F/D | load after")
    for rate in rates:
        load = os.getloadavg()[0]
        step = full_step_seconds(plain, budget)
        classes = cpu_classes(step)
        f, d = run(rate, MIX, "fcfs", n, classes), run(rate, MIX, "deadline", n, classes)
        # Two replicas, shared: each gets half the load; siloed: each class its own replica.
        sc = run(2 * rate * MIX["chat"], {"chat": 1.0}, "deadline", max(1, round(2 * n * MIX["chat"])), classes)
        sb = run(2 * rate * MIX["batch"], {"batch": 1.0}, "deadline", max(1, round(2 * n * MIX["batch"])), classes)
        print(f"  {rate:4.2f} | {step * 1e3:5.0f} ({load:4.1f}) | "
              f"{f.qos['chat'].attainment:6.1%} / {f.qos['batch'].attainment:6.1%} | "
              f"{d.qos['chat'].attainment:6.1%} / {d.qos['batch'].attainment:6.1%} ({d.qos['chat'].relegated}) | "
              f"{sc.qos['chat'].attainment:6.1%} / {sb.qos['batch'].attainment:6.1%} | "
              f"{violations(f)} / {violations(d)} of {f.qos[TIGHT].num_requests} | "
              f"{goodput(f):.3f} / {goodput(d):.3f} | {os.getloadavg()[0]:.2f}")
    executor.shutdown()
    print("  (shared at rate r = two replicas at 2r in all, each at r; the silos get 2r x each class's share)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=200, help="requests per simulated run")
    ap.add_argument("--probes", type=int, default=8, help="most simulated runs per capacity search")
    ap.add_argument("--engine-requests", type=int, default=10, help="requests per engine run (of the mix)")
    ap.add_argument("--engine-rates", default="0.12,0.25,0.5", help="QPS ladder of the engine runs")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--no-engine", action="store_true", help="simulator only")
    ap.add_argument("--no-sim", action="store_true", help="engine only")
    ap.add_argument("--smoke", action="store_true", help="a seconds-long run of the same code path (quick lane)")
    args = ap.parse_args()
    profiles, traces = list(PROFILES), list(TRACES)
    if args.smoke:
        profiles, traces, args.requests, args.probes = profiles[:1], traces[:1], 30, 3
        args.model, args.engine_requests, args.engine_rates = "tiny", 4, "2.0"
    print(f"load: {os.getloadavg()[0]:.2f} (1 min), {os.cpu_count()} CPUs")
    for profile in profiles if not args.no_sim else []:
        for trace in traces:
            start = time.perf_counter()
            print_cell(f"{profile} / {trace} ({args.requests} requests per run)",
                       sim_cell(profile, trace, args.requests, args.probes))
            print(f"  ({time.perf_counter() - start:.0f} s)")
    if not args.no_engine:
        engine_runs(args.model, args.engine_requests, [float(r) for r in args.engine_rates.split(",")],
                    1 / 64 if args.smoke else 1 / 16)
    print(f"load at the end: {os.getloadavg()[0]:.2f} (1 min)")


if __name__ == "__main__":
    main()
