"""QoS classes with deadlines: one deployment serving interactive (chat) and batch
traffic, deadline-aware (qos_policy "deadline") against the same scheduler run FCFS
(qos_policy "fcfs"), and against siloed replicas (one class each).

    python bench/bench_qos.py [--requests 200] [--no-engine | --no-sim] [--engine-requests 32] [--smoke]

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
the same three comparisons, side by side in one process: capacity searches for the mix
FCFS and deadline-aware on one engine (a replica of a shared pair) and for the two silos
(a chat-only and a batch-only engine, deadline-aware, with their shares of the pair's
requests), interleaved one probe each per round, then the overload runs, with the load
average beside every run.
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
    """One (profile, trace): capacities in QPS and the overload runs. `unbounded`: the
    capacities (\"fcfs\", \"deadline\", \"chat silo\", \"batch silo\") whose search ran out of
    probes with every rate passing, so that they are only lower bounds."""

    fcfs: float
    deadline: float
    silo_chat: float  # chat-only replica
    silo_batch: float  # batch-only replica
    overload: dict[float, tuple[MetricsSummary, MetricsSummary]]  # factor -> (fcfs, deadline)
    unbounded: frozenset[str] = frozenset()

    @property
    def siloed(self) -> float:
        """Total rate two silos carry: each class's share saturates its own replica."""
        return min(self.silo_chat / MIX["chat"], self.silo_batch / MIX["batch"])

    @property
    def siloed_unbounded(self) -> bool:
        """Whether the silo that sets `siloed` has only a lower bound."""
        chat = self.silo_chat / MIX["chat"] <= self.silo_batch / MIX["batch"]
        return f"{'chat' if chat else 'batch'} silo" in self.unbounded


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

    unbounded: set[str] = set()

    def cap(name: str, mix: dict[str, float], qos_policy: str) -> float:
        result = simulated_capacity(dataclasses.replace(work, qos_mix=mix), sched_config(blocks, qos_policy), cost,
                                    slo, qps_start=1.0, rel_tol=0.04, max_probes=probes)
        if not result.bounded:
            unbounded.add(name)
        return result.max_qps

    fcfs, deadline = cap("fcfs", MIX, "fcfs"), cap("deadline", MIX, "deadline")
    overload = {}
    for factor in (1.5, 2.0):
        reqs = make_workload(dataclasses.replace(work, qps=factor * fcfs))
        overload[factor] = tuple(simulate(reqs, sched_config(blocks, p), cost).summary() for p in ("fcfs", "deadline"))
    # Each silo gets the better of the two policies: a fair siloed baseline is the best
    # each dedicated replica can do (one class alone can still gain from deadline sizing).
    silo_chat, silo_batch = (max(cap(f"{name} silo", {name: 1.0}, p) for p in ("fcfs", "deadline"))
                             for name in ("chat", "batch"))
    return Cell(fcfs, deadline, silo_chat, silo_batch, overload, frozenset(unbounded))  # type: ignore[arg-type]


def qps(value: float, unbounded: bool) -> str:
    """A capacity, marked ">=" when its search found no failing rate."""
    return f"{'>=' if unbounded else ''}{value:.3g}"


def times(a: float, b: float, a_unbounded: bool = False, b_unbounded: bool = False) -> str:
    """a / b as "1.23x" (">=1.23x" when only a is a lower bound); a capacity of 0 (no
    probed rate passed) or a baseline b that is only a lower bound has no ratio."""
    if b <= 0:
        return "n/a (0 QPS)"
    if b_unbounded:
        return "n/a (the baseline's search found no failing rate)"
    return f"{'>=' if a_unbounded else ''}{a / b:.2f}x"


def print_cell(name: str, c: Cell) -> None:
    u = c.unbounded
    print(f"{name}: capacity at >= {ATTAINMENT:.0%} per class: FCFS {qps(c.fcfs, 'fcfs' in u)} QPS, deadline "
          f"{qps(c.deadline, 'deadline' in u)} QPS -> {times(c.deadline, c.fcfs, 'deadline' in u, 'fcfs' in u)} "
          f"(target >= 1.2x)")
    print(f"  shared vs siloed, two replicas: shared {qps(2 * c.deadline, 'deadline' in u)} QPS, siloed "
          f"{qps(c.siloed, c.siloed_unbounded)} QPS (chat silo {qps(c.silo_chat, 'chat silo' in u)}, batch silo "
          f"{qps(c.silo_batch, 'batch silo' in u)}) -> "
          f"{times(2 * c.deadline, c.siloed, 'deadline' in u, c.siloed_unbounded)} (target >= 1.25x)")
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


def engine_cell(model: str, n: int, length_scale: float, qps_start: float, probes: int) -> None:
    """The three comparisons on the real engine, side by side in one process: four
    capacity searches (the mix FCFS and deadline-aware on one engine, a replica of a
    shared pair; the chat-only and batch-only silos, deadline-aware: the better policy for
    a silo in every simulated cell, each with its share of twice the mix's requests) run
    round-robin, one probe each per round, so that the machine's drift on a shared host
    falls on all four alike; then the overload runs at 1.5x and 2x the FCFS capacity.
    Before every run a full step is measured and that run's classes scaled to it
    (cpu_classes): other work on a shared host slows every step, and deadlines scaled
    to a quieter minute would count the machine's slowdown as the policy's misses."""
    from sarathi_rt.engine import EngineConfig, LLMEngine
    from sarathi_rt.measure.metrics import summarize
    from sarathi_rt.harness.replay import replay, warm_up
    from sarathi_rt.sim.capacity import CapacitySearch

    # The simulator's token budget scaled with the prompt lengths (at least 32 tokens),
    # so a chunk is the same share of a prompt; half of it may be decodes.
    budget = max(32, round(SIM_TOKEN_BUDGET * length_scale))
    seqs = budget // 2
    plain = LLMEngine(EngineConfig(model=model, token_budget=budget, max_num_seqs=seqs, num_kv_blocks=512))
    executor = plain.executor
    warm_up(plain)
    steps: list[float] = []

    def run(rate: float, mix: dict[str, float], qos_policy: str, num_requests: int) -> MetricsSummary:
        steps.append(full_step_seconds(plain, budget))
        classes = cpu_classes(steps[-1])
        config = EngineConfig(model=model, token_budget=budget, max_num_seqs=seqs, num_kv_blocks=512,
                              qos_classes=classes, qos_policy=qos_policy)
        engine = LLMEngine(config, executor=executor)
        warm_up(engine)
        work = make_workload(WorkloadConfig(num_requests=num_requests, qps=rate, lengths="sharegpt",
                                            length_scale=length_scale, max_total_tokens=2048, qos_mix=mix, seed=1))
        return summarize(*replay(engine, work), qos_classes=classes)

    ratios = ", ".join(f"{k} ttft {c.ttft / CLASSES[TIGHT].tbt:g} tbt {c.tbt / CLASSES[TIGHT].tbt:g}"
                       for k, c in CLASSES.items())
    print(f"engine: {model} on the CPU, ShareGPT x{length_scale:g}, token budget {budget}, {n} requests per mix "
          f"run; classes in units of {CPU_TBT_STEPS:g} full steps, measured before each run: {ratios}")
    # name -> (class mix, policy, requests, start rate): a silo gets its class's share of
    # the pair's rate and requests, so its runs last as long as the mix's.
    configs = {"fcfs": (MIX, "fcfs", n, qps_start), "deadline": (MIX, "deadline", n, qps_start),
               **{f"{k} silo": ({k: 1.0}, "deadline", max(1, round(2 * n * share)), 2 * qps_start * share)
                  for k, share in MIX.items()}}
    searches = {name: CapacitySearch(name, qps_start=start, rel_tol=0.1, max_probes=probes)
                for name, (_, _, _, start) in configs.items()}
    slo = AttainmentSLO(ATTAINMENT)
    print("  round | config      |  QPS  | step ms | attained per class    | ok | load")
    for round_ in range(probes):
        for name, search in searches.items():
            if (rate := search.next_qps()) is None:
                continue
            mix, policy, requests, _ = configs[name]
            summary = run(rate, mix, policy, requests)
            passed = slo.met_by(summary)
            search.record(summary, passed)
            attained = ", ".join(f"{k} {q.attainment:.0%}" for k, q in summary.qos.items() if q.num_requests)
            print(f"  {round_:5d} | {name:11s} | {rate:5.3f} | {steps[-1] * 1e3:7.0f} | {attained:21s} | {'y' if passed else 'n'}  | "
                  f"{os.getloadavg()[0]:.1f}", flush=True)
    cap = {name: s.result.max_qps for name, s in searches.items()}
    if cap["fcfs"] == 0:
        executor.shutdown()
        print("  FCFS failed at every probed rate: no overload to run (lower --engine-start)")
        return
    overload = {factor: tuple(run(factor * cap["fcfs"], MIX, policy, n) for policy in ("fcfs", "deadline"))
                for factor in (1.5, 2.0)}
    unbounded = frozenset(name for name, s in searches.items() if not s.result.bounded)
    cell = Cell(cap["fcfs"], cap["deadline"], cap["chat silo"], cap["batch silo"], overload,  # type: ignore[arg-type]
                unbounded)
    executor.shutdown()
    print_cell(f"engine ({n} requests per mix run)", cell)
    print(f"  full steps measured before the runs: {min(steps) * 1e3:.0f}-{max(steps) * 1e3:.0f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=200, help="requests per simulated run")
    ap.add_argument("--probes", type=int, default=8, help="most simulated runs per capacity search")
    ap.add_argument("--engine-requests", type=int, default=32, help="requests per engine run of the mix")
    ap.add_argument("--engine-start", type=float, default=0.3, help="QPS the engine's capacity searches start at")
    ap.add_argument("--engine-probes", type=int, default=5, help="most engine runs per capacity search")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--no-engine", action="store_true", help="simulator only")
    ap.add_argument("--no-sim", action="store_true", help="engine only")
    ap.add_argument("--smoke", action="store_true", help="a seconds-long run of the same code path (quick lane)")
    args = ap.parse_args()
    profiles, traces = list(PROFILES), list(TRACES)
    if args.smoke:
        profiles, traces, args.requests, args.probes = profiles[:1], traces[:1], 30, 3
        args.model, args.engine_requests, args.engine_start, args.engine_probes = "tiny", 4, 2.0, 2
    print(f"load: {os.getloadavg()[0]:.2f} (1 min), {os.cpu_count()} CPUs")
    for profile in profiles if not args.no_sim else []:
        for trace in traces:
            start = time.perf_counter()
            print_cell(f"{profile} / {trace} ({args.requests} requests per run)",
                       sim_cell(profile, trace, args.requests, args.probes))
            print(f"  ({time.perf_counter() - start:.0f} s)")
    if not args.no_engine:
        engine_cell(args.model, args.engine_requests, 1 / 64 if args.smoke else 1 / 16, args.engine_start,
                    args.engine_probes)
    print(f"load at the end: {os.getloadavg()[0]:.2f} (1 min)")


if __name__ == "__main__":
    main()
