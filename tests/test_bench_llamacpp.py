"""bench/bench_llamacpp.py without a network or a llama.cpp build: the command lines it
runs, the order of its interleaved repetitions and the table it prints."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from bench_llamacpp import (BUSY_LOAD, REGIMES, Run, Side, cmake_commands, convert, interleave,  # noqa: E402
                            llama_side, quantize_command, sarathi_side, sdist_command, slots, summarize, workload)


def test_the_build_fetches_only_the_sdist_and_builds_the_two_tools(tmp_path: Path) -> None:
    fetch = sdist_command(tmp_path)
    assert fetch[fetch.index("--no-binary") + 1] == "llama-cpp-python"  # not :all:, which builds cmake itself
    assert "--no-deps" in fetch and "llama-cpp-python==0.3.36" in fetch
    configure, build = cmake_commands(tmp_path / "src", tmp_path / "build", jobs=1)
    assert "-DGGML_NATIVE=ON" in configure and "-DCMAKE_BUILD_TYPE=Release" in configure
    assert build[build.index("-j") + 1] == "1"
    assert build[build.index("--target") + 1:] == ["llama-server", "llama-quantize"]
    assert quantize_command(tmp_path, Path("m.Q4_1.gguf"), Path("m.BF16.gguf"), "bfloat16")[-1] == "BF16"
    assert quantize_command(tmp_path, Path("m.Q4_1.gguf"), Path("m.F32.gguf"), "float32")[-1] == "F32"


def test_convert_makes_its_folder(tmp_path: Path) -> None:
    """With --llama-dir (an existing build) nothing created the converted models' folder,
    so llama-quantize could not write there: convert makes it. A stand-in llama-quantize
    copies its input."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    tool = bin_dir / "llama-quantize"
    tool.write_text('#!/bin/sh\ncp "$2" "$3"\n')
    tool.chmod(0o755)
    source = tmp_path / "m.Q4_1.gguf"
    source.write_bytes(b"GGUF")
    out = convert(bin_dir, source, "float32", tmp_path / "cache" / "llama.cpp")
    assert out == tmp_path / "cache" / "llama.cpp" / "m.F32.gguf" and out.read_bytes() == b"GGUF"


def test_both_servers_get_the_same_threads_and_enough_context(tmp_path: Path) -> None:
    llama = llama_side(tmp_path, Path("m.gguf"), 2, "-b 512 -ub 512 -np 64 -kvu", longest=300).command(8080)
    assert llama[llama.index("-t") + 1] == llama[llama.index("-tb") + 1] == "2"
    assert int(llama[llama.index("-c") + 1]) == 19200  # 64 slots x 300 tokens, a multiple of 256
    assert llama[-5:] == ["-kvu", "--host", "127.0.0.1", "--port", "8080"]
    assert "--no-cache-prompt" in llama and llama[llama.index("-np") + 1] == "64"
    ours = sarathi_side("m.gguf", "bfloat16", 2).command(8081)
    assert ours[ours.index("--threads") + 1] == "2" and ours[ours.index("--dtype") + 1] == "bfloat16"
    assert ours[-4:] == ["--host", "127.0.0.1", "--port", "8081"]


def test_llama_flags_must_give_the_slot_count() -> None:
    assert slots("-b 512 --parallel 16") == 16
    with pytest.raises(ValueError, match="--llama-flags .* must give -np"):
        slots("-b 512 -ub 512")


def test_repetitions_alternate_the_order() -> None:
    a, b = Side("a", ()), Side("b", ())
    order = [(r, s.name) for r, s in interleave([a, b], 3)]
    assert order == [(0, "a"), (0, "b"), (1, "b"), (1, "a"), (2, "a"), (2, "b")]


def test_the_regimes_are_16_and_64_poisson_requests_and_64_at_once() -> None:
    assert [len(workload(r, 1 / 8, 0)) for r in REGIMES.values()] == [16, 64, 64]
    burst = workload(REGIMES["all64"], 1 / 8, 0)
    assert burst[-1].arrival_time < 1e-3
    assert workload(REGIMES["poisson64"], 1 / 8, 0)[-1].arrival_time > 5.0  # 64 requests at 4 QPS


def _run(side: str, tok_s: float, load: float = 0.5) -> Run:
    return Run(side, "float32", "all64", 0, tok_s, ttft_p50=0.2, tbt_p99=0.05, load_before=load, load_after=load)


def test_the_table_shows_medians_and_their_ratio() -> None:
    runs = [_run("ours", 100.0), _run("peer", 50.0), _run("peer", 80.0), _run("ours", 300.0), _run("ours", 120.0),
            _run("peer", 60.0)]
    lines = summarize(runs, "ours", "peer")
    assert any(line.split()[2:4] == ["ours", "120.0"] for line in lines)
    assert any(line.split()[2:4] == ["peer", "60.0"] for line in lines)
    assert lines[-1] == "float32 all64: ratio ours / peer 2.00x (target >= 1.5x)"


def test_runs_on_a_busy_machine_are_flagged() -> None:
    runs = [_run("ours", 100.0, load=BUSY_LOAD + 1), _run("peer", 100.0)]
    assert runs[0].busy and not runs[1].busy
    last = summarize(runs, "ours", "peer")[-1]
    assert "1.00x" in last and "1 run(s) started on a busy machine" in last
