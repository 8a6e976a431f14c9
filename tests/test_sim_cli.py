"""`sarathi-rt bench --simulate`: the summary.json shape, plots and per-policy records."""
from __future__ import annotations

import json

import pytest

from sarathi_rt.cli import main
from sarathi_rt.measure.metrics import load_requests_csv

KEYS = ["ttft_p50", "ttft_p99", "tbt_p50", "tbt_p99", "stalls", "tokens_per_s", "sched_delay_p50",
        "tbt_p999", "tbt_max", "request_max_tbt", "prefill_wait_share", "goodput", "ttft_target", "tbt_target",
        "step_error_p50", "step_error_p99", "under_predicted"]


@pytest.mark.slow
def test_bench_simulated_writes_summary_and_plots(tmp_path, capsys) -> None:
    out = tmp_path / "b"
    assert main(["bench", "--simulate", "--num-requests", "30", "--length-scale", "0.25", "--qps", "2",
                 "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert list(summary) == ["sarathi", "vllm", "orca"]
    for record in summary.values():
        assert list(record) == KEYS and isinstance(record["stalls"], int) and record["tokens_per_s"] > 0
    for png in ("tbt_cdf.png", "tokens_per_step.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"
    assert len(load_requests_csv(out / "vllm_requests.csv")) == 30
    printed = capsys.readouterr().out
    assert "TBT P99" in printed and "sarathi P99 TBT / vllm P99 TBT" in printed


def test_bench_rejects_bad_flags(tmp_path) -> None:
    with pytest.raises(ValueError, match="--policy"):
        main(["bench", "--simulate", "--policy", "sarathi,nope", "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="qps"):
        main(["bench", "--simulate", "--qps", "-1", "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="tp=3"):
        main(["bench", "--simulate", "--tensor-parallel-size", "3", "--out", str(tmp_path)])


def test_bench_adaptive_budget_flags(tmp_path, capsys) -> None:
    with pytest.raises(ValueError, match="--budget-rule adaptive needs --tbt-slo"):
        main(["bench", "--simulate", "--budget-rule", "adaptive", "--out", str(tmp_path)])
    out = tmp_path / "a"
    assert main(["bench", "--simulate", "--policy", "sarathi", "--num-requests", "20", "--qps", "2",
                 "--token-budget", "4096", "--tbt-slo", "0.12", "--ttft-slo", "2", "--hardware", "h200",
                 "--out", str(out)]) == 0
    record = json.loads((out / "summary.json").read_text())["sarathi"]
    assert record["tbt_max"] <= 0.12 and record["tbt_target"] == 0.12 and record["goodput"] > 0
    assert "prefill wait" in capsys.readouterr().out
