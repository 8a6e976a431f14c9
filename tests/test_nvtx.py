"""NVTX ranges as a tool sees them: a small injection library, built here and loaded
the way nsys loads its own (NVTX_INJECTION64_PATH, InitializeInjectionNvtx2), records
every push and pop of one engine step of a mixed batch (a decode and a prefill), and the
test checks the names, the nesting and that every push has its pop, for the engine's
phases (Python) and the core's ops (C++)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sarathi_rt import _C

pytestmark = pytest.mark.skipif(not _C.NVTX, reason="the core was built without the NVTX3 headers")

PHASES = ["schedule", "prepare", "forward", "sample", "detokenize"]
CORE_OPS = {"attention_plan", "attention", "write_kv", "gemm"}
# One step with a decode (request a) beside a prefill (b); prints the step's token counts.
# Every linear layer takes the core's CPU GEMM (by default only weights of 16 MiB and up).
STEP = """
import importlib, json
from sarathi_rt import LLM, SamplingParams
importlib.import_module("sarathi_rt.ops.linear")._STREAMED_WEIGHT_BYTES = 0
llm = LLM("tiny", block_size=8, token_budget=64, max_num_seqs=4, num_kv_blocks=64)
engine, greedy = llm.engine, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
engine.add_request("a", list(range(3, 11)), greedy)
engine.step()
engine.add_request("b", list(range(20, 60)), greedy)
engine.step()
s = engine.step_metrics[-1]
print(json.dumps([s.num_prefill_tokens, s.num_decode_tokens, llm.engine.model_config.num_hidden_layers]))
"""


@pytest.fixture(scope="module")
def recorder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the NVTX recorder")
    lib = tmp_path_factory.mktemp("nvtx") / "libnvtx_record.so"
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-I", _C.NVTX_INCLUDE, str(Path(__file__).with_name("nvtx_record.c")),
                    "-o", str(lib), "-lpthread"], check=True)
    return lib


def _record(recorder: Path, tmp_path: Path, mode: str) -> tuple[list[tuple[str, int, str, str]], list[int]]:
    log = tmp_path / f"{mode}.log"
    env = {**os.environ, "NVTX_INJECTION64_PATH": str(recorder), "NVTX_RECORD_LOG": str(log),
           "SARATHI_RT_NVTX": mode, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", STEP], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    events = []
    for line in log.read_text().splitlines():
        kind, thread, domain, name = line.split("\t")
        events.append((kind, int(thread), domain, name))
    return events, json.loads(done.stdout.splitlines()[-1])


def _trees(events: list[tuple[str, int, str, str]]) -> list[dict]:
    """The top-level ranges, each {"name", "children"}, after checking that on every
    thread each pop closes an open push and nothing stays open."""
    stacks: dict[int, list[dict]] = {}
    roots: list[dict] = []
    for kind, thread, domain, name in events:
        assert domain == "sarathi_rt"
        stack = stacks.setdefault(thread, [])
        if kind == "push":
            node = {"name": name, "children": []}
            (stack[-1]["children"] if stack else roots).append(node)
            stack.append(node)
        else:
            assert stack, f"a pop without a push on thread {thread}"
            stack.pop()
    assert all(not s for s in stacks.values()), "ranges left open"
    return roots


def _names(node: dict) -> list[str]:
    return [c["name"] for c in node["children"]]


def test_one_mixed_step_names_nesting_and_balance_in_detail(recorder: Path, tmp_path: Path) -> None:
    events, (prefill, decode, num_layers) = _record(recorder, tmp_path, "detail")
    assert prefill == 40 and decode == 1  # the last step was mixed
    steps = [r for r in _trees(events) if r["name"] == "step"]
    assert len(steps) == 2
    mixed = steps[-1]
    assert _names(mixed) == PHASES
    prepare, forward = mixed["children"][1], mixed["children"][2]
    assert _names(prepare) == ["attention_plan"]  # planned once per step (C++)
    assert _names(forward) == [f"layer{i}" for i in range(num_layers)] + ["logits"]
    *layers, logits = forward["children"]
    for layer in layers:
        ops = _names(layer)
        assert ops.count("write_kv") == 1 and ops.count("attention") == 1 and "gemm" in ops, ops
        assert set(ops) <= CORE_OPS and all(not op["children"] for op in layer["children"])
    assert set(_names(logits)) == {"gemm"}  # the LM head
    for phase in ("schedule", "sample", "detokenize"):
        assert not next(c for c in mixed["children"] if c["name"] == phase)["children"]


def test_phases_only_by_default(recorder: Path, tmp_path: Path) -> None:
    events, _ = _record(recorder, tmp_path, "phases")
    steps = [r for r in _trees(events) if r["name"] == "step"]
    assert len(steps) == 2 and all(_names(s) == PHASES and all(not c["children"] for c in s["children"])
                                   for s in steps)
    assert not {name for _, _, _, name in events} & (CORE_OPS | {"layer0"})
