"""Deployment planner on the simulator: pruning drops only what cannot work, the pruned
search finds the same cheapest plan as trying everything, every plan meets the SLO
when re-simulated at its share of the rate, and the command's --json output."""
from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from sarathi_rt.cli import main
from sarathi_rt.measure.metrics import Distribution, MetricsSummary, summarize
from sarathi_rt.sim.deploy import DeploymentRequest, DeploymentSLO, plan_deployment
from sarathi_rt.scheduler import SchedulerConfig
from sarathi_rt.sim import VidurCostModel, simulate
from sarathi_rt.workloads import WorkloadConfig, data_path, make_workload

PROFILE = data_path("a100_llama-3-8b_mlp.csv.gz")
WORKLOAD = WorkloadConfig(num_requests=60, lengths="sharegpt", length_scale=0.5, seed=3)
SMALL = DeploymentRequest(qps=4.0, slo=DeploymentSLO(0.1), profile=PROFILE, gpus_per_node=2, max_gpus=4,
                    policies=("sarathi",), top=1)


def test_impossible_slo_is_pruned_without_simulating() -> None:
    result = plan_deployment(replace(SMALL, slo=DeploymentSLO(0.001)), WORKLOAD)
    assert result.deployments == [] and result.simulated == 0
    # TP 1 x PP 1, 2, 4 and TP 2 x PP 1, 2 (PP divides the 32 layers, TP x PP <= 4 GPUs)
    assert result.pruned == {"one decode step alone exceeds the TBT SLO": 5}


@pytest.mark.slow
def test_pruned_search_finds_the_exhaustive_optimum() -> None:
    pruned = plan_deployment(SMALL, WORKLOAD)
    everything = plan_deployment(replace(SMALL, top=100), WORKLOAD)
    assert pruned.deployments and pruned.simulated < everything.simulated
    assert "cannot beat the plans already found" in pruned.pruned
    assert pruned.deployments[0].gpus == min(p.gpus for p in everything.deployments)
    assert [p.gpus for p in everything.deployments] == sorted(p.gpus for p in everything.deployments)


@pytest.mark.slow
def test_every_plan_meets_the_slo_at_its_share_of_the_rate() -> None:
    request = replace(SMALL, top=3)
    for plan in plan_deployment(request, WORKLOAD).deployments:
        assert plan.gpus <= request.max_gpus and plan.tp <= request.gpus_per_node
        assert plan.replicas == math.ceil(request.qps / plan.capacity_qps)
        assert plan.headroom == pytest.approx(plan.replicas * plan.capacity_qps / request.qps - 1)
        cost = VidurCostModel(PROFILE, tp=plan.tp)
        config = SchedulerConfig(policy=plan.policy, token_budget=plan.token_budget, max_num_seqs=128,
                                 num_blocks=cost.kv_cache_blocks(16, 80e9, pipeline_stages=plan.pp),
                                 max_partial_prefills=plan.pp)
        share = request.qps / plan.replicas
        res = simulate(make_workload(replace(WORKLOAD, qps=share)), config, cost, pipeline_stages=plan.pp)
        assert share <= plan.capacity_qps
        assert request.slo.met_by(summarize(res.requests[len(res.requests) // 2:], res.steps))


def test_ttft_limit_and_bad_arguments() -> None:
    summary = MetricsSummary(1, 1, Distribution(0.5, 0.5, 0.5, 0.5, 0.5), Distribution(0, 0, 0.01, 0, 0.01),
                             Distribution(0, 0, 0, 0, 0), *[Distribution.of([])] * 2, 0, 0.0, 1.0, 1, 1, 0, 1.0)
    assert DeploymentSLO(0.1).met_by(summary) and DeploymentSLO(0.1, ttft_p50=1.0).met_by(summary)
    assert not DeploymentSLO(0.1, ttft_p50=0.4).met_by(summary)
    with pytest.raises(ValueError, match="ttft_p50 must be a positive"):
        DeploymentSLO(0.1, ttft_p50=0)
    with pytest.raises(ValueError, match="hardware must be one of"):
        replace(SMALL, hardware="tpu")
    with pytest.raises(ValueError, match="max_gpus must be a positive int"):
        replace(SMALL, max_gpus=0)
    with pytest.raises(ValueError, match="qps must be a positive"):
        replace(SMALL, qps=-1.0)


@pytest.mark.slow
def test_plan_command_json(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["deploy", "--qps", "2", "--tbt-slo", "0.1", "--gpus-per-node", "1", "--max-gpus", "2",
                 "--policy", "sarathi", "--num-requests", "60", "--top", "1", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and len(out["plans"]) == 1
    plan = out["plans"][0]
    assert plan["gpus"] == plan["replicas"] * plan["tp"] * plan["pp"] <= 2
    assert plan["capacity_qps"] * plan["replicas"] >= 2
    assert out["simulated"] + sum(out["pruned"].values()) == 2  # TP 1 x PP 1 and 2
