"""--qos-classes / --qos-mix / --qos-policy / --attainment on `bench` and `capacity`
(simulator; the engine backend reads the same flags), and their bad input."""
from __future__ import annotations

import json

import pytest

from sarathi_rt.cli import main

CLASSES = {"chat": {"ttft": 2.0, "tbt": 0.1, "priority": 1}, "batch": {"ttft": 60, "tbt": 0.5}}
SIM = ["--simulate", "--num-requests", "16", "--token-budget", "512"]


@pytest.fixture
def classes(tmp_path) -> str:
    path = tmp_path / "qos.json"
    path.write_text(json.dumps(CLASSES))
    return str(path)


def test_bench_prints_and_saves_a_per_class_table(classes, tmp_path, capsys) -> None:
    assert main(["bench", *SIM, "--policy", "sarathi,vllm", "--qos-classes", classes,
                 "--qos-mix", "chat=0.35,batch=0.65", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "attainment" in out and " chat " in out and " batch " in out
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert set(summary["sarathi"]["qos"]) == {"chat", "batch"}  # vllm is measured per class under FCFS
    assert sum(c["num_requests"] for c in summary["vllm"]["qos"].values()) == 16


def test_capacity_by_attainment(classes, tmp_path, capsys) -> None:
    assert main(["capacity", *SIM, "--policy", "sarathi", "--qos-classes", classes, "--qos-mix", "chat=0.5,batch=0.5",
                 "--qos-policy", "fcfs", "--attainment", "0.9", "--max-probes", "3", "--out", str(tmp_path)]) == 0
    assert "chat" in capsys.readouterr().out
    assert json.loads((tmp_path / "capacity.json").read_text())["sarathi"] > 0


@pytest.mark.parametrize("extra,match", [
    (["--qos-mix", "chat=1"], "--qos-mix needs --qos-classes"),
    (["--qos-policy", "fcfs"], "--qos-policy needs --qos-classes"),
    (["--qos-classes", "CLASSES"], "--qos-classes needs --qos-mix"),
    (["--qos-classes", "CLASSES", "--qos-mix", "chat=0.5,batch=0.4"], "--qos-mix: qos_mix fractions must sum to 1"),
    (["--qos-classes", "CLASSES", "--qos-mix", "chat:1"], "--qos-mix must be NAME=FRACTION"),
    (["--qos-classes", "CLASSES", "--qos-mix", "gold=1"], r"--qos-mix names \['gold'\]"),
    (["--qos-classes", "NOTJSON", "--qos-mix", "chat=1"], "qos_classes .* is not valid JSON"),
    (["--qos-classes", "BADCLASS", "--qos-mix", "chat=1"], r"qos_classes\['chat'\]: tbt must be"),
    (["--qos-classes", "MISSING", "--qos-mix", "chat=1"], "qos_classes .*No such file"),
])
def test_bad_qos_flags_name_the_flag(extra, match, classes, tmp_path) -> None:
    (tmp_path / "bad.json").write_text("{chat: 1")
    (tmp_path / "badclass.json").write_text(json.dumps({"chat": {"ttft": 1, "tbt": -1}}))
    paths = {"CLASSES": classes, "NOTJSON": str(tmp_path / "bad.json"), "BADCLASS": str(tmp_path / "badclass.json"),
             "MISSING": str(tmp_path / "missing.json")}
    with pytest.raises(ValueError, match=match):
        main(["bench", *SIM, *[paths.get(a, a) for a in extra], "--out", str(tmp_path)])


def test_endpoint_refuses_qos_flags(classes, tmp_path) -> None:
    with pytest.raises(ValueError, match="--qos-classes, --qos-mix not used by --endpoint"):
        main(["bench", "--endpoint", "http://127.0.0.1:9/v1", "--qos-classes", classes, "--qos-mix", "chat=1",
              "--out", str(tmp_path)])


def test_attainment_without_classes_is_an_error(tmp_path) -> None:
    with pytest.raises(ValueError, match="--attainment needs --qos-classes"):
        main(["capacity", *SIM, "--tbt-slo", "0.2", "--attainment", "0.9", "--out", str(tmp_path)])
