"""Speculative decoding in the simulator (issue 40 item 4): per-request acceptance from a
trace column or a distribution, accepted counts drawn per step, the real Scheduler
driven through set_proposals and update(..., accepted=...)."""
from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from sarathi_rt.scheduler import SchedulerConfig
from sarathi_rt.sim import AcceptanceDistribution, LinearCostModel, SimSpeculation, simulate
from sarathi_rt.workloads import RequestSpec, WorkloadConfig, load_trace, make_workload

COST = LinearCostModel(fixed_s=0.01, per_token_s=1e-4)


def _config(**kw: object) -> SchedulerConfig:
    return SchedulerConfig(**{"token_budget": 512, "max_num_seqs": 32, "num_blocks": 2048, "block_size": 16} | kw)


def _workload(n: int = 12, acceptance: float | None = None) -> list[RequestSpec]:
    return [RequestSpec(i, 0.02 * i, 40 + 13 * i, 30 + 7 * i, acceptance=acceptance) for i in range(n)]


def test_every_request_gets_exactly_its_tokens_in_fewer_steps() -> None:
    work = _workload()
    plain = simulate(work, _config(), COST)
    for a in (0.0, 0.5, 0.9, 1.0):
        spec = simulate(work, _config(), COST, speculation=SimSpeculation(4, AcceptanceDistribution(a)))
        assert [len(r.token_times) for r in spec.requests] == [w.num_decode_tokens for w in work], a
        assert all(r.finish_time is not None for r in spec.requests)
        if a >= 0.9:  # most steps yield several tokens per decode
            assert len(spec.steps) < 0.6 * len(plain.steps), a
            assert spec.makespan < plain.makespan
    # Speculation makes steps wider: the verification rows are in the plan's tokens.
    spec = simulate(work, _config(), COST, speculation=SimSpeculation(4, AcceptanceDistribution(0.9)))
    assert max(s.num_decode_tokens for s in spec.steps) > max(s.num_decode_tokens for s in plain.steps)


def test_the_same_inputs_give_the_same_run() -> None:
    work = _workload()
    spec = SimSpeculation(4, AcceptanceDistribution(0.6, 0.2), seed=3)
    a, b = (simulate(work, _config(), COST, speculation=spec) for _ in range(2))
    assert [r.token_times for r in a.requests] == [r.token_times for r in b.requests]
    c = simulate(work, _config(), COST, speculation=SimSpeculation(4, AcceptanceDistribution(0.6, 0.2), seed=4))
    assert [r.token_times for r in a.requests] != [r.token_times for r in c.requests]


def test_a_request_s_own_rate_overrides_the_distribution() -> None:
    """Requests that accept every draft finish in fewer steps than ones that accept none,
    beside each other in one run whose distribution says 0.5."""
    work = [RequestSpec(i, 0.0, 64, 96, acceptance=1.0 if i % 2 else 0.0) for i in range(8)]
    res = simulate(work, _config(), COST, speculation=SimSpeculation(4, AcceptanceDistribution(0.5)))
    finish = [r.finish_time for r in res.requests]
    assert max(finish[1::2]) < min(finish[0::2])


def test_a_request_without_a_rate_needs_a_distribution() -> None:
    with pytest.raises(ValueError, match="--acceptance"):
        simulate(_workload(), _config(), COST, speculation=SimSpeculation(4))
    with pytest.raises(ValueError, match="chunking policy"):
        simulate(_workload(), _config(policy="vllm"), COST, speculation=SimSpeculation(4, AcceptanceDistribution(0.5)))
    with pytest.raises(ValueError, match="request 0: acceptance must be in"):
        simulate(_workload(acceptance=1.5), _config(), COST, speculation=SimSpeculation(4))
    # Every request carrying its own rate needs none.
    res = simulate(_workload(acceptance=0.7), _config(), COST, speculation=SimSpeculation(4))
    assert all(r.finish_time is not None for r in res.requests)


def test_speculation_keeps_the_tbt_target() -> None:
    """With the adaptive budget (tbt_slo), draft rows never take a step past the target
    that plain decoding keeps."""
    work = make_workload(WorkloadConfig(num_requests=40, qps=20.0, lengths="uniform", prompt_range=(64, 512),
                                        decode_range=(32, 128), seed=1))
    cfg = _config(token_budget=2048, tbt_slo=0.05, tile_size=1)
    res = simulate(work, cfg, COST, speculation=SimSpeculation(8, AcceptanceDistribution(0.8)))
    assert max(s.duration for s in res.steps) <= 0.05 + 1e-9
    assert sum(s.num_decode_tokens for s in res.steps) > sum(len(r.token_times) for r in res.requests) * 0.5


def test_trace_acceptance_column(tmp_path: Path) -> None:
    path = tmp_path / "t.csv.gz"
    with gzip.open(path, "wt") as f:
        f.write("num_prefill_tokens,num_decode_tokens,acceptance\n" + "".join(
            f"{10 + i},{5 + i},{i / 10}\n" for i in range(10)))
    trace = load_trace(str(path))
    assert trace.acceptance is not None and list(trace.acceptance) == pytest.approx([i / 10 for i in range(10)])
    work = make_workload(WorkloadConfig(num_requests=6, lengths=str(path), seed=0))
    # Each request keeps its own row's rate: decode length 5 + i goes with acceptance i / 10.
    assert all(r.acceptance == pytest.approx((r.num_decode_tokens - 5) / 10) for r in work)
    assert all(r.acceptance is None for r in make_workload(WorkloadConfig(num_requests=3, lengths="fixed")))
    bad = tmp_path / "bad.csv"
    bad.write_text("num_prefill_tokens,num_decode_tokens,acceptance\n10,5,1.5\n")
    with pytest.raises(ValueError, match="acceptance"):
        load_trace(str(bad))


def test_acceptance_flag_parses() -> None:
    assert AcceptanceDistribution.parse("0.6") == AcceptanceDistribution(0.6)
    assert AcceptanceDistribution.parse("0.6,0.1") == AcceptanceDistribution(0.6, 0.1)
    for bad in ("x", "0.5,0.1,0.2", ""):
        with pytest.raises(ValueError, match="--acceptance"):
            AcceptanceDistribution.parse(bad)
    with pytest.raises(ValueError, match="mean"):
        AcceptanceDistribution.parse("1.5")


@pytest.mark.slow
def test_capacity_command_answers_what_speculation_buys(tmp_path: Path) -> None:
    """`capacity --simulate` with the config tree's --speculative-method/-k and the
    simulator's --acceptance: at acceptance 0.9 the same SLO holds a higher rate."""
    from sarathi_rt.cli import main

    caps = {}
    for name, extra in (("plain", []), ("spec", ["--speculative-method", "ngram", "--speculative-k", "4",
                                                 "--acceptance", "0.9,0.05"])):
        out = tmp_path / name
        assert main(["capacity", "--simulate", "--policy", "sarathi", "--tbt-slo", "0.05", "--num-requests", "100",
                     "--max-probes", "8", "--rel-tol", "0.1", "--out", str(out), *extra]) == 0
        caps[name] = json.loads((out / "capacity.json").read_text())["sarathi"]
    assert caps["spec"] > 1.2 * caps["plain"] > 0


def test_capacity_speculation_flags_are_checked(tmp_path: Path) -> None:
    from sarathi_rt.cli import main

    args = ["capacity", "--simulate", "--tbt-slo", "0.05", "--out", str(tmp_path / "x")]
    with pytest.raises(ValueError, match="--acceptance and --speculative-k are used only with --speculative-method"):
        main([*args, "--policy", "sarathi", "--acceptance", "0.5"])
    with pytest.raises(ValueError, match="chunking policy .* policy 'vllm' prefills whole prompts"):
        main([*args, "--policy", "sarathi,vllm", "--speculative-method", "ngram", "--acceptance", "0.5"])
    with pytest.raises(ValueError, match="--acceptance"):
        main([*args, "--policy", "sarathi", "--speculative-method", "ngram", "--acceptance", "2"])
    with pytest.raises(ValueError, match="used only with --speculative-method"):
        main([*args, "--policy", "sarathi", "--speculative-k", "2"])
    with pytest.raises(ValueError, match="--acceptance"):  # not read by the engine
        main(["capacity", "--tbt-slo", "0.05", "--acceptance", "0.5", "--out", str(tmp_path / "x")])


DEPLOY = ["deploy", "--qps", "2", "--tbt-slo", "0.1", "--gpus-per-node", "1", "--max-gpus", "1",
          "--policy", "sarathi", "--num-requests", "40", "--top", "1", "--json"]


@pytest.mark.slow
def test_deploy_with_speculation(capsys: pytest.CaptureFixture[str]) -> None:
    from sarathi_rt.cli import main

    assert main([*DEPLOY, "--speculative-method", "ngram", "--speculative-k", "4", "--acceptance", "0.8"]) == 0
    assert json.loads(capsys.readouterr().out)["plans"]


def test_deploy_speculation_flags_are_checked() -> None:
    from sarathi_rt.cli import main

    base = DEPLOY
    with pytest.raises(ValueError, match="--speculative-ngram-max not used by the simulator"):
        main([*base, "--speculative-method", "ngram", "--speculative-ngram-max", "3", "--acceptance", "0.8"])
    with pytest.raises(ValueError, match="used only with --speculative-method"):
        main([*base, "--acceptance", "0.8"])
    with pytest.raises(ValueError, match="chunking policy"):
        main([*base[:-7], "--policy", "vllm", "--num-requests", "40", "--json", "--speculative-method", "ngram",
              "--acceptance", "0.8"])
