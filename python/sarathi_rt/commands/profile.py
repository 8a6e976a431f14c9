"""`sarathi-rt profile`: measure the engine's steps by shape (decode-only batches on a
dense grid up to max_num_seqs, prefill chunks, mixed batches, at the workload's mean
context) and its per-step host overhead, with the same engine settings and workload
flags as `sarathi-rt bench`; saves OUT/step_profile.json for
`sarathi-rt bench --simulate --step-profile OUT/step_profile.json`."""
from __future__ import annotations

import argparse
import os
import statistics

from sarathi_rt.sim.shape_model import ShapeCostModel
from sarathi_rt.workloads import make_workload

from ._serving import EngineBackend, add_common_args, fill_defaults, parse_policies, policy_options, workload_config


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("profile", help="measure the engine's step times by batch shape",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p, policies="sarathi,vllm", simulator=False)
    p.add_argument("--qps", type=float, default=0.75, help="request rate of the host-overhead run")
    # Single timings of a batch jitter on a shared CPU; the median of enough shuffled
    # rounds keeps the dense-grid fit from following that noise (bench/RESULTS.md,
    # simulator fidelity, has the rounds it took).
    p.add_argument("--repeats", type=int, default=9, help="timed runs (shuffled rounds) of each batch")
    p.add_argument("--calibration-requests", type=int, default=6,
                   help="requests of the workload run for real to measure the host overhead (0: none)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    fill_defaults(args, num_requests=(12, 1000), length_scale=(1 / 8, 1.0))
    policies = parse_policies(args.policy)
    backend = EngineBackend(args)
    try:
        return _profile(args, policies, backend)
    finally:
        backend.close()  # stops the engine's worker processes, if any


def _profile(args: argparse.Namespace, policies: list[str], backend: EngineBackend) -> int:
    workload = make_workload(workload_config(args, args.qps, backend.max_total_tokens))
    context = round(statistics.mean(r.num_prompt_tokens + r.num_decode_tokens / 2 for r in workload))
    # The largest chunk any of the policies runs: vllm and orca prefill whole prompts.
    max_chunk = max(o.get("chunk_size") or o["token_budget"] for o in (policy_options(args, p, workload)
                                                                        for p in policies))
    max_chunk = min(max_chunk, max(r.num_prompt_tokens for r in workload))
    from sarathi_rt.harness.replay import warm_up
    from sarathi_rt.harness.shape_profiling import profile_engine
    import torch

    from sarathi_rt.utils.dtypes import dtype_name

    engine = backend.engine("sarathi", workload)
    # The dtype the engine chose (--dtype may be left to the CPU's BF16 rule).
    config = engine.config
    threads = torch.get_num_threads()
    settings = {"model": str(args.model), "device": str(config.device), "dtype": dtype_name(config.dtype),
                "threads": threads, "block_size": config.block_size,
                "num_kv_blocks": engine.executor.num_kv_blocks, "max_num_seqs": config.max_num_seqs,
                "token_budget": config.token_budget, "max_total_tokens": backend.max_total_tokens,
                "context_len": context}
    warm_up(engine)
    print(f"sarathi-rt profile: {args.model} on {config.device}, {threads} thread(s); decodes up to "
          f"{config.max_num_seqs}, chunks up to {max_chunk}, contexts {max(1, context // 4)} and {context}")
    profile = profile_engine(engine, context, config.max_num_seqs, max_chunk, workload[:args.calibration_requests],
                             repeats=args.repeats, seed=args.seed, engine_settings=settings)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "step_profile.json")
    profile.save(path)
    model = ShapeCostModel(profile)
    fit = [abs(model.model_time(s.shape()) - s.median) / s.median for s in profile.steps]
    print(f"{len(profile.steps)} batches x {args.repeats}; repeats spread (median) {100 * profile.spread():.1f}%; "
          f"host overhead {profile.host_overhead_s * 1e3:.2f} ms/step; fit error median "
          f"{100 * statistics.median(fit):.1f}%, max {100 * max(fit):.1f}%")
    print(f"wrote {path}")
    return 0
