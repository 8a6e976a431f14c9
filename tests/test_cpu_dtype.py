"""The CPU's dtype rule (sarathi_rt.utils.cpu): bfloat16 by default where the CPU has
native BF16, float32 elsewhere; an explicit bfloat16 without it falls back to float32
with one warning line, unless SARATHI_RT_CPU_BF16=emulate forces it. The CPU flags are
faked (conftest pins them empty; these tests set the ones they need)."""
from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

import sarathi_rt.config.tree
from sarathi_rt import LLM, SamplingParams
from sarathi_rt.cli import main
from sarathi_rt.engine import EngineConfig, worker
from sarathi_rt.utils.cpu import BF16_FLAGS, bf16_forced, cpu_dtype, cpu_flags, is_amd, missing_bf16

WITH_BF16 = [{"avx2", "avx512f", "avx512_bf16"}, {"avx2", "amx_bf16", "amx_tile"}]
WITHOUT_BF16 = [set(), {"avx2", "fma", "avx512f", "avx512_vnni"}]


def _fake_flags(monkeypatch: pytest.MonkeyPatch, flags: set[str]) -> None:
    monkeypatch.setattr(sarathi_rt.config.tree, "cpu_flags", lambda: set(flags))


def _bf16_warnings(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "sarathi_rt" and "native BF16" in r.getMessage()]


@pytest.mark.parametrize("flags", WITH_BF16)
def test_the_default_is_bfloat16_where_the_cpu_has_it(flags: set[str]) -> None:
    assert cpu_dtype(None, flags, forced=False) == ("bfloat16", None)
    assert cpu_dtype("bfloat16", flags, forced=False) == ("bfloat16", None)
    assert cpu_dtype("float32", flags, forced=False) == ("float32", None)  # one flag away


@pytest.mark.parametrize("flags", WITHOUT_BF16)
def test_the_default_is_float32_elsewhere_and_bfloat16_falls_back(flags: set[str]) -> None:
    assert cpu_dtype(None, flags, forced=False) == ("float32", None)
    assert cpu_dtype(None, flags, forced=True) == ("float32", None)  # the variable forces only an explicit bf16
    assert cpu_dtype("float16", flags, forced=False) == ("float16", None)
    dtype, warning = cpu_dtype("bfloat16", flags, forced=False)
    assert dtype == "float32" and warning is not None and "\n" not in warning
    assert all(flag in warning for flag in BF16_FLAGS) and "SARATHI_RT_CPU_BF16=emulate" in warning
    assert cpu_dtype("bfloat16", flags, forced=True) == ("bfloat16", None)


def test_cpu_flags_read_the_first_cpu(tmp_path: Path) -> None:
    assert missing_bf16({"avx2", "fma"}) == BF16_FLAGS
    assert missing_bf16({"avx2", "avx512_bf16"}) == () and missing_bf16({"amx_bf16"}) == ()
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu avx2 fma\nbugs\t\t: none\nprocessor\t: 1\nflags\t\t: fpu\n")
    assert cpu_flags(info, environ={}) == {"fpu", "avx2", "fma"}
    assert cpu_flags(tmp_path / "absent", environ={}) == set()  # no /proc/cpuinfo (not Linux): no native bf16 assumed


def test_the_variable_takes_emulate_or_nothing() -> None:
    assert bf16_forced({}) is False and bf16_forced({"SARATHI_RT_CPU_BF16": ""}) is False
    assert bf16_forced({"SARATHI_RT_CPU_BF16": "Emulate"}) is True
    with pytest.raises(ValueError, match="SARATHI_RT_CPU_BF16 must be 'emulate' or unset, got 'on'"):
        bf16_forced({"SARATHI_RT_CPU_BF16": "on"})


def test_engine_config_applies_the_rule(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    _fake_flags(monkeypatch, WITH_BF16[0])
    assert EngineConfig(model="tiny").dtype is torch.bfloat16
    assert EngineConfig(model="tiny", dtype="float32").dtype is torch.float32
    _fake_flags(monkeypatch, WITHOUT_BF16[1])
    assert EngineConfig(model="tiny").dtype is torch.float32
    assert EngineConfig(model="tiny", dtype=torch.float16).dtype is torch.float16
    assert not _bf16_warnings(caplog)
    monkeypatch.setenv("SARATHI_RT_CPU_BF16", "1")
    with pytest.raises(ValueError, match="SARATHI_RT_CPU_BF16"):
        EngineConfig(model="tiny")


@pytest.mark.parametrize("dtype", ["bfloat61", "int8", ""])
def test_unknown_dtype_names_the_argument(dtype: str) -> None:
    with pytest.raises(ValueError, match=f"dtype must be float32, float16 or bfloat16 .*got {dtype!r}"):
        EngineConfig(model="tiny", dtype=dtype)


def test_bfloat16_without_bf16_warns_once_and_runs_float32(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="sarathi_rt"):
        llm = LLM("tiny", dtype="bfloat16", num_kv_blocks=8, block_size=8)
        out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False)[0]
    model = llm.engine.executor.worker.model
    assert llm.engine.config.dtype is model.dtype is model.lm_head.dtype is torch.float32
    assert len(out.token_ids) == 3
    (record,) = _bf16_warnings(caplog)  # one line, once for the engine (not per step, layer or worker)
    assert record.levelno == logging.WARNING and "\n" not in record.getMessage()
    assert "avx512_bf16 or amx_bf16" in record.getMessage() and "SARATHI_RT_CPU_BF16=emulate" in record.getMessage()


def test_emulate_forces_bfloat16(emulated_bf16: None, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="sarathi_rt"):
        llm = LLM("tiny", dtype="bfloat16", num_kv_blocks=8, block_size=8)
        out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False)[0]
    w = llm.engine.executor.worker
    assert w.model.dtype is w.model.lm_head.dtype is w.kv_cache.k[0].dtype is torch.bfloat16
    assert len(out.token_ids) == 3 and not _bf16_warnings(caplog)


def test_the_command_line_follows_the_rule(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    loaded: list[torch.dtype] = []
    real = worker.load_model

    def spy(model, dtype, device, layout, seed):
        loaded.append(dtype)
        return real(model, dtype, device, layout, seed)

    monkeypatch.setattr(worker, "load_model", spy)
    _fake_flags(monkeypatch, WITH_BF16[1])
    generate = ["generate", "--model", "tiny", "--prompt-ids", "1", "2", "--max-tokens", "2"]
    assert main(generate) == 0 and main([*generate, "--dtype", "float32"]) == 0
    assert loaded == [torch.bfloat16, torch.float32]


def test_serve_and_bench_leave_the_dtype_to_the_rule() -> None:
    import argparse

    from sarathi_rt.commands import bench, serve
    from sarathi_rt.commands._serving import fill_defaults

    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    serve.add_parser(sub), bench.add_parser(sub)
    assert "dtype" not in serve.engine_options(parser.parse_args(["serve"]))[0]
    assert serve.engine_options(parser.parse_args(["serve", "--dtype", "float32"]))[0]["dtype"] == "float32"
    args = parser.parse_args(["bench", "--model", "tiny"])
    fill_defaults(args)
    assert "dtype" not in args.options  # EngineConfig applies the rule


@pytest.mark.parametrize("vendor, amd", [("AuthenticAMD", True), ("GenuineIntel", False)])
def test_is_amd_reads_the_vendor(tmp_path: Path, vendor: str, amd: bool) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text(f"processor\t: 0\nvendor_id\t: {vendor}\nflags\t\t: fpu avx2\n")
    assert is_amd(info) is amd
    assert is_amd(tmp_path / "missing") is False
