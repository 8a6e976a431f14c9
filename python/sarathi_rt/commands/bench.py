"""`sarathi-rt bench`: serve the same workload with several scheduling policies and
compare latency: TTFT, TBT, generation stalls, throughput, scheduling delay.

By default it runs the real engine on the CPU (SmolLM2-135M-Instruct, fetched on first
use; ShareGPT lengths scaled to 1/8) and then shows a few of the model's answers.
`--simulate` replays the workload through the simulator with an A100 cost model instead,
and `--endpoint URL` sends it to an OpenAI-compatible server (this one's `sarathi-rt
serve`, or any other) and measures what its clients see."""
from __future__ import annotations

import argparse
import json
import math
import os
import time

from tqdm.auto import tqdm

from sarathi_rt.measure.metrics import MetricsSummary, QoSSummary, save_requests_csv, save_steps_csv, summarize
from sarathi_rt.measure.slo import SLOMetrics, slo_metrics
from sarathi_rt.workloads import make_workload

from sarathi_rt.scheduler import get_policy

from ._serving import (EndpointBackend, EngineBackend, SimBackend, add_common_args, fill_defaults, make_backend,
                       optional_plots, parse_policies, policy_budget, slo_derived_budget, workload_config)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("bench", help="compare scheduling policies on one workload",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p, policies="sarathi,vllm,orca")
    p.add_argument("--qps", type=float, default=None, help="request rate (default: 0.75 on the engine, 1.5 simulated)")
    p.add_argument("--ttft-slo", type=float, default=None, help="time-to-first-token target (s) of goodput")
    e = p.add_argument_group("endpoint (instead of the engine)")
    e.add_argument("--endpoint", default=None, metavar="URL",
                   help="replay against this OpenAI-compatible server (e.g. http://127.0.0.1:8000/v1)")
    e.add_argument("--vocab-size", type=int,
                   help="--endpoint: prompt token ids are drawn below this (default 32000)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    fill_defaults(args, qps=(0.75, 1.5), num_requests=(12, 1000), length_scale=(1 / 8, 1.0))
    policies = ["endpoint"] if args.endpoint else parse_policies(args.policy)
    backend = make_backend(args)
    try:
        return _bench(args, policies, backend)
    finally:
        backend.close()  # stops the engine's worker processes, if any


def _bench(args: argparse.Namespace, policies: list[str], backend: SimBackend | EngineBackend | EndpointBackend
           ) -> int:
    workload = make_workload(workload_config(args, args.qps, backend.max_total_tokens))
    os.makedirs(args.out, exist_ok=True)
    if not args.endpoint:
        slo_derived_budget(args, backend)
    mode = f"{backend.model} at {args.endpoint}" if args.endpoint else \
        f"{'simulator' if args.simulate else f'{args.model} on {args.device}'}; {budget_text(args, backend)}"
    # Timings are only comparable on an equally loaded machine: say how loaded this one is.
    print(f"sarathi-rt bench: {len(workload)} requests of {args.trace} (length x{args.length_scale:.4g}) at "
          f"{args.qps:g} QPS, {mode} (machine load {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)")
    summaries: dict[str, MetricsSummary] = {}
    slos: dict[str, SLOMetrics] = {}
    tbts, steps_by_policy = {}, {}
    for policy in policies:
        start = time.perf_counter()
        with tqdm(total=len(workload), desc=f"{policy:>8}", unit="req", leave=False) as bar:
            requests, steps = backend.run(policy, workload, bar.update)
        summaries[policy] = summarize(requests, steps, args.stall_factor, getattr(args, "qos_classes", None))
        slos[policy] = slo_metrics(requests, steps, args.ttft_slo, args.tbt_slo)
        tbts[policy] = [g for r in requests for g in r.tbts]
        steps_by_policy[policy] = steps
        save_requests_csv(os.path.join(args.out, f"{policy}_requests.csv"), requests)
        save_steps_csv(os.path.join(args.out, f"{policy}_steps.csv"), steps)
        done = f"{len(steps)} steps" if steps else f"{len(requests)} requests"
        print(f"  {policy}: {done} in {time.perf_counter() - start:.1f} s")
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump({p: {**s.bench_dict(), **slos[p].to_dict(),
                       **({"qos": {c: qos_dict(q) for c, q in s.qos.items()}} if s.qos else {})}
                   for p, s in summaries.items()}, f, indent=2)
    written = "summary.json"
    plots = optional_plots()
    if plots is not None:
        plots.plot_tbt_cdf(tbts, os.path.join(args.out, "tbt_cdf.png"))
        written += ", tbt_cdf.png"
        if any(steps_by_policy.values()):  # a server measured from outside has no step records
            plots.plot_tokens_per_step(steps_by_policy, os.path.join(args.out, "tokens_per_step.png"))
            written += ", tokens_per_step.png"
    print(format_table(summaries))
    print(format_slo_table(slos))
    if getattr(args, "qos_classes", None):
        print(format_qos_table(summaries))
    if "sarathi" in summaries and "vllm" in summaries:
        s, v = summaries["sarathi"], summaries["vllm"]
        ratio = s.tbt.p99 / v.tbt.p99 if v.tbt.p99 > 0 else math.nan
        print(f"sarathi P99 TBT / vllm P99 TBT = {ratio:.3f}; stalls {s.stalls} vs {v.stalls}")
    print(f"wrote {args.out}/{written} and per-policy CSVs (machine load {os.getloadavg()[0]:.1f} at the end)")
    if isinstance(backend, EngineBackend):
        show_answers(backend, policies[0], workload)
    return 0


SAMPLE_CHATS = ["What is the capital of France?", "Name three colours of the rainbow.",
                "Write one sentence about the sea."]


def budget_text(args: argparse.Namespace, backend: SimBackend | EngineBackend) -> str:
    """The budget the chunked policies get, as the budget rule chose it."""
    chunked = [p for p in parse_policies(args.policy) if get_policy(p).chunked] or parse_policies(args.policy)
    budget = policy_budget(args, chunked[0])
    if budget.tbt_slo is not None:
        return f"{chunked[0]}: each step sized to the {budget.tbt_slo * 1e3:g} ms SLO, at most {budget.token_budget} tokens"
    return f"{chunked[0]}: token budget {budget.token_budget}"


def show_answers(backend: EngineBackend, policy: str, workload: list) -> None:
    """A few greedy answers, by an engine like the measured ones: the text a real model
    makes (random weights and models without a chat template have none to show)."""
    tokenizer = backend.tokenizer
    if tokenizer is None or tokenizer.chat_template is None:
        return
    from sarathi_rt.sampling import SamplingParams

    engine = backend.engine(policy, workload)
    for i, question in enumerate(SAMPLE_CHATS):
        engine.add_request(i, tokenizer.apply_chat_template([{"role": "user", "content": question}]),
                           SamplingParams(max_tokens=48, temperature=0.0))
    answers: dict[object, str] = {}
    while engine.has_unfinished():
        answers |= {out.request_id: out.text or "" for out in engine.step() if out.finished}
    print(f"{backend.args.model} answers ({policy}, greedy):")
    for i, question in enumerate(SAMPLE_CHATS):
        print(f"  > {question}\n    {' '.join(answers[i].split())}")


def format_table(summaries: dict[str, MetricsSummary]) -> str:
    head = ["policy", "TTFT P50", "TTFT P99", "TBT P50", "TBT P99", "stalls", "tokens/s", "sched P50",
            "preempt"]
    rows = [[p, _ms(s.ttft.p50), _ms(s.ttft.p99), _ms(s.tbt.p50), _ms(s.tbt.p99), str(s.stalls),
             f"{s.tokens_per_s:.1f}", _ms(s.sched_delay.p50), str(s.num_preemptions)]
            for p, s in summaries.items()]
    widths = [max(len(r[i]) for r in [head] + rows) for i in range(len(head))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in [head] + rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines) + "\n(times in ms)"


def format_slo_table(slos: dict[str, SLOMetrics]) -> str:
    head = ["policy", "TBT P99.9", "TBT max", "worst gap P50", "prefill wait", "goodput", "step err P50",
            "step err P99"]
    rows = [[p, _ms(m.tbt_p999), _ms(m.tbt_max), _ms(m.request_max_tbt.p50), _pct(m.prefill_wait_share),
             "n/a" if math.isnan(m.goodput) else f"{m.goodput:.3f}/s", _pct(m.step_error_p50), _pct(m.step_error_p99)]
            for p, m in slos.items()]
    widths = [max(len(r[i]) for r in [head] + rows) for i in range(len(head))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in [head] + rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines) + "\n(goodput: requests within --ttft-slo and --tbt-slo; step err: the adaptive " \
                               "budget's step-time forecasts)"


def qos_dict(q: QoSSummary) -> dict[str, float | int]:
    return {"num_requests": q.num_requests, "attainment": q.attainment, "goodput": q.goodput,
            "relegated": q.relegated, "ttft_p50": q.ttft.p50, "ttft_p99": q.ttft.p99, "tbt_p50": q.tbt.p50,
            "tbt_p99": q.tbt.p99}


def format_qos_table(summaries: dict[str, MetricsSummary]) -> str:
    head = ["policy", "class", "requests", "attainment", "goodput", "relegated", "TTFT P50", "TTFT P99",
            "TBT P99"]
    rows = [[p, c, str(q.num_requests), _pct(q.attainment), f"{q.goodput:.3f}/s", str(q.relegated), _ms(q.ttft.p50),
             _ms(q.ttft.p99), _ms(q.tbt.p99)] for p, s in summaries.items() for c, q in s.qos.items()]
    widths = [max(len(r[i]) for r in [head] + rows) for i in range(len(head))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in [head] + rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines) + "\n(attainment: requests whose every token met its class's cumulative deadline)"


def _pct(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{100 * x:.1f}%"


def _ms(seconds: float) -> str:
    return "n/a" if math.isnan(seconds) else f"{seconds * 1e3:.1f}"
