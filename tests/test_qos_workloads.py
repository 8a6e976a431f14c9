"""QoS in workloads (RequestSpec.qos, WorkloadConfig.qos_mix), in the metrics summary
(MetricsSummary.qos) and in the simulator."""
import math
from dataclasses import replace

import pytest

from sarathi_rt.measure.metrics import RequestMetrics, load_requests_csv, save_requests_csv, summarize
from sarathi_rt.scheduler import QoSClass, SchedulerConfig
from sarathi_rt.sim import simulate
from sarathi_rt.sim.cost import LinearCostModel
from sarathi_rt.workloads import WorkloadConfig, make_workload

MIX = {"chat": 0.35, "batch": 0.65}
CLASSES = {"chat": QoSClass(ttft=1.0, tbt=0.1), "batch": QoSClass(ttft=30.0, tbt=1.0)}


@pytest.mark.parametrize("mix,match", [
    ({"chat": 0.5, "batch": 0.4}, "sum to 1"), ({}, "non-empty"), ({"chat": 0.0, "batch": 1.0}, r"qos_mix\['chat'\]"),
    ({"chat": -0.5, "batch": 1.5}, r"qos_mix\['chat'\]"), ([("chat", 1.0)], "mapping"), ({"": 1.0}, "names"),
])
def test_qos_mix_rejects_bad_fractions(mix, match):
    with pytest.raises(ValueError, match=match):
        WorkloadConfig(lengths="fixed", qos_mix=mix)


def test_qos_mix_is_seeded_and_leaves_lengths_and_arrivals_alone():
    base = WorkloadConfig(num_requests=400, lengths="uniform", seed=3)
    plain, mixed = make_workload(base), make_workload(replace(base, qos_mix=MIX))
    assert [(r.arrival_time, r.num_prompt_tokens, r.num_decode_tokens) for r in plain] == \
        [(r.arrival_time, r.num_prompt_tokens, r.num_decode_tokens) for r in mixed]
    assert mixed == make_workload(replace(base, qos_mix=MIX))
    share = sum(r.qos == "chat" for r in mixed) / len(mixed)
    assert 0.28 < share < 0.42 and {r.qos for r in mixed} == {"chat", "batch"}
    assert all(r.qos is None for r in plain)


def test_summary_per_class_attainment_goodput_relegations():
    chat = QoSClass(ttft=1.0, tbt=0.5)
    reqs = [RequestMetrics(0.0, 10, first_token_time=0.5, token_times=[0.5, 1.4], finish_time=1.4, qos="chat"),
            RequestMetrics(0.0, 10, first_token_time=2.0, token_times=[2.0], finish_time=2.0, qos="chat",
                           relegated=True),
            RequestMetrics(0.0, 10, first_token_time=0.1, token_times=[0.1], finish_time=4.0, qos="batch")]
    s = summarize(reqs, [], qos_classes={"chat": chat, "batch": QoSClass(ttft=0.05, tbt=1.0)})
    assert s.qos["chat"].num_requests == 2 and s.qos["chat"].attainment == 0.5
    assert s.qos["chat"].goodput == pytest.approx(1 / 4.0) and s.qos["chat"].relegated == 1
    assert s.qos["chat"].ttft.p50 == pytest.approx(1.25) and s.qos["batch"].attainment == 0.0
    assert summarize(reqs, []).qos == {}


def test_requests_csv_round_trips_qos(tmp_path):
    reqs = [RequestMetrics(0.0, 10, token_times=[0.5], qos="chat", relegated=True), RequestMetrics(1.0, 3)]
    save_requests_csv(tmp_path / "r.csv", reqs)
    assert load_requests_csv(tmp_path / "r.csv") == reqs


def test_simulator_reports_each_class_and_fcfs_matches_no_classes():
    work = make_workload(WorkloadConfig(num_requests=60, qps=20.0, lengths="uniform", qos_mix=MIX, seed=1))
    cost = LinearCostModel(fixed_s=0.01, per_token_s=1e-4)
    plain = simulate([replace(r, qos=None) for r in work], SchedulerConfig(), cost)
    fcfs = simulate(work, SchedulerConfig(qos_classes=CLASSES, qos_policy="fcfs"), cost)
    assert [r.token_times for r in fcfs.requests] == [r.token_times for r in plain.requests]
    deadline = simulate(work, SchedulerConfig(qos_classes=CLASSES), cost).summary()
    assert set(deadline.qos) == {"chat", "batch"}
    assert sum(q.num_requests for q in deadline.qos.values()) == 60
    assert all(0.0 <= q.attainment <= 1.0 for q in deadline.qos.values())
    # a request without a class takes the default; none and no default is an error naming qos
    dflt = simulate([replace(r, qos=None) for r in work],
                    SchedulerConfig(qos_classes=CLASSES, default_qos="batch"), cost).summary()
    assert dflt.qos["batch"].num_requests == 60 and math.isnan(dflt.qos["chat"].attainment)
    with pytest.raises(ValueError, match="qos is required"):
        simulate([replace(r, qos=None) for r in work], SchedulerConfig(qos_classes=CLASSES), cost)


def test_configs_with_classes_pickle() -> None:
    # Configs travel to worker processes (torchrun, multiprocessing): a read-only view
    # that does not pickle broke `launch ... serve`, whose default tiers are classes.
    import pickle

    from sarathi_rt.config import EngineConfig
    from sarathi_rt.scheduler import QoSClass, SchedulerConfig

    classes = {"chat": QoSClass(1.0, 0.1), "batch": QoSClass(60.0, 1.0)}
    for config in (SchedulerConfig(qos_classes=classes, default_qos="chat", qos_policy="fcfs"),
                   EngineConfig(model="tiny", qos_classes=classes, default_qos="chat"),
                   WorkloadConfig(num_requests=4, qps=1.0, qos_mix={"chat": 0.5, "batch": 0.5})):
        copy = pickle.loads(pickle.dumps(config))
        assert copy == config
    with pytest.raises(TypeError):
        config.qos_mix["chat"] = 1.0  # type: ignore[index]
