"""Workloads: seeded arrivals and lengths from the shipped traces or synthetic ones."""
from __future__ import annotations

import numpy as np
import pytest

from sarathi_rt.workloads import BUILTIN_TRACES, WorkloadConfig, load_trace, make_workload


def test_builtin_traces_ship_with_the_package() -> None:
    sizes = {"sharegpt": 30731, "arxiv": 28257, "splitwise": 19366}
    for name in BUILTIN_TRACES:
        t = load_trace(name)
        assert len(t) == sizes[name]
        assert (t.num_prompt_tokens > 0).all() and (t.num_decode_tokens > 0).all()
    assert np.median(load_trace("sharegpt").num_prompt_tokens) == 1730
    assert load_trace("splitwise").arrival_times is not None
    assert load_trace("sharegpt").arrival_times is None


def test_same_seed_same_workload_other_seed_differs() -> None:
    cfg = WorkloadConfig(num_requests=50, qps=3.0, seed=7)
    assert make_workload(cfg) == make_workload(cfg)
    assert make_workload(cfg) != make_workload(WorkloadConfig(num_requests=50, qps=3.0, seed=8))


@pytest.mark.parametrize("arrival", ["poisson", "gamma"])
def test_random_arrivals_have_the_requested_rate(arrival: str) -> None:
    w = make_workload(WorkloadConfig(num_requests=4000, qps=5.0, arrival=arrival, lengths="fixed", cv=3.0))
    times = np.array([r.arrival_time for r in w])
    assert times[0] == 0.0 and (np.diff(times) >= 0).all()
    gaps = np.diff(times)
    assert gaps.mean() == pytest.approx(0.2, rel=0.1)
    cv = gaps.std() / gaps.mean()
    assert cv == pytest.approx(1.0 if arrival == "poisson" else 3.0, rel=0.2)


def test_fixed_lengths_and_arrivals_are_exact() -> None:
    w = make_workload(WorkloadConfig(num_requests=4, qps=2.0, arrival="fixed", lengths="fixed",
                                     prompt_len=100, decode_len=7))
    assert [(r.request_id, r.arrival_time, r.num_prompt_tokens, r.num_decode_tokens) for r in w] == \
        [(0, 0.0, 100, 7), (1, 0.5, 100, 7), (2, 1.0, 100, 7), (3, 1.5, 100, 7)]


def test_uniform_lengths_stay_in_range() -> None:
    w = make_workload(WorkloadConfig(num_requests=300, lengths="uniform", prompt_range=(5, 9), decode_range=(2, 3)))
    assert {r.num_prompt_tokens for r in w} == set(range(5, 10))
    assert {r.num_decode_tokens for r in w} == {2, 3}


def test_length_scale_and_max_total_tokens() -> None:
    trace = load_trace("sharegpt")
    w = make_workload(WorkloadConfig(num_requests=500, length_scale=0.1, max_total_tokens=300))
    assert all(r.num_prompt_tokens + r.num_decode_tokens <= 300 for r in w)
    pairs = set(zip(np.maximum(1, np.rint(trace.num_prompt_tokens * 0.1)).astype(int).tolist(),
                    np.maximum(1, np.rint(trace.num_decode_tokens * 0.1)).astype(int).tolist()))
    assert all((r.num_prompt_tokens, r.num_decode_tokens) in pairs for r in w)


def test_csv_trace_with_its_own_arrivals(tmp_path) -> None:
    path = tmp_path / "t.csv"
    path.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n10,5,2\n11,6,3\n14,7,4\n")
    w = make_workload(WorkloadConfig(num_requests=3, qps=0.5, arrival="trace", lengths=str(path)))
    # Trace spans 4 s for 2 gaps (0.5 QPS): the rescale to 0.5 QPS keeps the times.
    assert [r.arrival_time for r in w] == pytest.approx([0.0, 1.0, 4.0])
    assert [r.num_prompt_tokens for r in w] == [5, 6, 7]
    w2 = make_workload(WorkloadConfig(num_requests=3, qps=1.0, arrival="trace", lengths=str(path)))
    assert [r.arrival_time for r in w2] == pytest.approx([0.0, 0.5, 2.0])


@pytest.mark.parametrize("kwargs, match", [
    ({"num_requests": 0}, "num_requests"), ({"qps": 0.0}, "qps"), ({"qps": float("inf")}, "qps"),
    ({"arrival": "bursty"}, "arrival"), ({"length_scale": -1.0}, "length_scale"),
    ({"lengths": "/no/such.csv"}, "trace must be one of"), ({"prompt_range": (9, 5)}, "prompt_range"),
    ({"arrival": "trace", "lengths": "fixed"}, "arrival='trace'"), ({"cv": 0.0}, "cv"),
])
def test_bad_config_names_the_field(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        WorkloadConfig(**kwargs)


def test_bad_trace_files(tmp_path) -> None:
    (tmp_path / "cols.csv").write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="needs columns"):
        load_trace(str(tmp_path / "cols.csv"))
    (tmp_path / "neg.csv").write_text("num_prefill_tokens,num_decode_tokens\n0,2\n")
    with pytest.raises(ValueError, match="non-positive"):
        load_trace(str(tmp_path / "neg.csv"))
    with pytest.raises(ValueError, match="arrived_at"):
        make_workload(WorkloadConfig(num_requests=2, arrival="trace", lengths="sharegpt"))
    with pytest.raises(ValueError, match="fits max_total_tokens"):
        make_workload(WorkloadConfig(num_requests=2, max_total_tokens=2))


@pytest.mark.parametrize("text, match", [
    ("num_prefill_tokens,num_decode_tokens\n", r"t.csv' has no requests"),
    ("", r"t.csv' has no requests"),
    ("prompt,output\n5,2\n", r"t.csv' needs columns .*got \['output', 'prompt'\]"),
    ("num_prefill_tokens,num_decode_tokens\ninf,2\n", r"t.csv' has a cell that is not a finite number"),
    ("num_prefill_tokens,num_decode_tokens\n5\n", r"t.csv' has a cell that is not a finite number"),
    ("arrived_at,num_prefill_tokens,num_decode_tokens\n0,5,2\nnan,6,3\n", r"t.csv': arrived_at must be finite"),
])
def test_trace_that_does_not_fit_names_the_file(tmp_path, text: str, match: str) -> None:
    path = tmp_path / "t.csv"
    path.write_text(text)
    with pytest.raises(ValueError, match=match):
        WorkloadConfig(lengths=str(path))  # checked when configured, before any run


def test_trace_with_no_request_left_after_filtering(tmp_path) -> None:
    (tmp_path / "t.csv.gz").write_text("not gzip")
    with pytest.raises(ValueError, match=r"t.csv.gz' cannot be read as a CSV"):
        load_trace(str(tmp_path / "t.csv.gz"))
    path = tmp_path / "long.csv"
    path.write_text("num_prefill_tokens,num_decode_tokens\n900,100\n2000,10\n")
    with pytest.raises(ValueError, match=r"no request of trace '.*long.csv' fits max_total_tokens=512 at "
                                         r"length_scale=1.0: its 2 requests hold 1000 tokens or more"):
        make_workload(WorkloadConfig(num_requests=4, lengths=str(path), max_total_tokens=512))
    assert len(make_workload(WorkloadConfig(num_requests=4, lengths=str(path), max_total_tokens=1000))) == 4
