"""Two nodes on one machine: two torchrun invocations on 127.0.0.1 (--nnodes 2
--nproc-per-node 2, gloo) give the single process's greedy tokens with TP=2 x PP=2 and
with TP=4 over 2 KV heads; `python -m sarathi_rt.launch` runs bench and serve (one HTTP
completion, then SIGTERM) and every rank exits 0; a worker killed, stopped (SIGSTOP) or
hung in a step on node 1 fails node 0 with an error naming it within the timeout, and every process of the
job ends. The other ranks serve with rank 0's engine configuration."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import sarathi_rt
from sarathi_rt import LLM

sys.path.insert(0, str(Path(__file__).parent))
from torchrun_job import ENGINE, PARAMS, PROMPTS  # noqa: E402

JOB = str(Path(__file__).parent / "torchrun_job.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(program: list[str]) -> list[subprocess.Popen]:
    port = str(_free_port())
    # The workers import sarathi_rt from where this process did (an install, or python/ in
    # a development tree), not from the checkout's sources, which may hold no built core.
    package_root = str(Path(sarathi_rt.__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([package_root, os.environ.get("PYTHONPATH", "")]))
    return [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
                              "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", port,
                              *program], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                             start_new_session=True) for node in (0, 1)]


def _finish(nodes: list[subprocess.Popen], timeout: float) -> list[tuple[int, str]]:
    """Each node's (exit status, output). A node still running after `timeout` seconds is
    killed and fails the test with every node's output: a torchrun agent that hangs is
    often waiting, in its exit barrier, for another node whose rank failed."""
    deadline = time.monotonic() + timeout
    results, hung = [], []
    try:
        for node, p in enumerate(nodes):
            try:
                out = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                out, hung = p.communicate(), hung + [node]
            results.append((p.returncode, "".join(out)))
    finally:
        for p in nodes:  # a hung job must not outlive the test
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    if hung:
        pytest.fail(f"node {', '.join(map(str, hung))} still running after {timeout:g} s\n" + "\n".join(
            f"--- node {node}, exit status {code}:\n{out[-4000:]}" for node, (code, out) in enumerate(results)))
    return results


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    with LLM("tiny", **ENGINE) as llm:
        return [list(o.token_ids) for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp", [(2, 2), (4, 1)], ids=["tp2-pp2", "tp4-kv-replicated"])
def test_two_nodes_match_one_process(reference, tp: int, pp: int) -> None:
    (code0, out0), (code1, out1) = _finish(_launch([JOB, "generate", str(tp), str(pp)]), timeout=150)
    assert code0 == 0 and code1 == 0, out0 + out1
    tokens = re.search(r"TOKENS (.*)", out0)
    assert tokens is not None, out0
    assert json.loads(tokens.group(1)) == reference
    assert "TOKENS" not in out1  # only world rank 0 drives
    # Every rank ended its heartbeat and watchdog threads before exiting.
    assert sorted(re.findall(r"THREADS rank (\d): \[\]", out0 + out1)) == ["0", "1", "2", "3"], out0 + out1


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _rank_pids(agent: subprocess.Popen) -> dict[int, int]:
    """World rank -> pid of the worker processes one torchrun agent started."""
    pids = {}
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1]) == agent.pid:
                env = dict(v.split("=", 1) for v in (proc / "environ").read_text().split("\0") if "=" in v)
                pids[int(env["RANK"])] = int(proc.name)
        except (OSError, KeyError, IndexError):  # gone meanwhile, or not a worker
            continue
    return pids


LAUNCH = ["-m", "sarathi_rt.launch", "--model", "tiny", "--tensor-parallel-size", "2", "--pipeline-parallel-size", "2",
          "--worker-timeout", "30"]


@pytest.mark.slow
def test_launch_runs_bench_on_two_nodes(tmp_path) -> None:
    out = tmp_path / "bench"
    (code0, out0), (code1, out1) = _finish(_launch([*LAUNCH, "bench", "--policy", "sarathi", "--num-requests", "6",
                                                    "--qps", "20", "--out", str(out)]), timeout=150)
    assert code0 == 0 and code1 == 0, out0 + out1
    assert re.search(r"sarathi: \d+ steps", out0), out0
    assert len((out / "sarathi_requests.csv").read_text().splitlines()) == 1 + 6
    assert json.loads((out / "summary.json").read_text())["sarathi"]["tokens_per_s"] > 0
    assert "sarathi-rt bench" not in out1  # node 1's ranks only serve


@pytest.mark.slow
def test_launch_serves_http_and_every_rank_exits_0_on_sigterm(reference) -> None:
    httpx = pytest.importorskip("httpx")
    port = _free_port()
    nodes = _launch([*LAUNCH, "serve", "--port", str(port), "--log-level", "warning"])
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            assert time.monotonic() < deadline and nodes[0].poll() is None, "the server did not come up"
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.5)
        reply = httpx.post(f"{url}/v1/completions", timeout=60, json=dict(
            prompt=PROMPTS[0], max_tokens=PARAMS.max_tokens, temperature=0, ignore_eos=True)).json()
        pids = _rank_pids(nodes[0]) | _rank_pids(nodes[1])
        os.kill(pids[0], signal.SIGTERM)
        (code0, out0), (code1, out1) = _finish(nodes, timeout=60)
    finally:
        for p in nodes:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    assert reply["choices"][0]["finish_reason"] == "length", reply
    assert reply["usage"]["completion_tokens"] == len(reference[0]) == PARAMS.max_tokens
    assert code0 == 0 and code1 == 0, out0[-3000:] + out1[-3000:]
    assert sorted(pids) == [0, 1, 2, 3]
    time.sleep(0.5)
    assert not [p for p in pids.values() if _alive(p)]


SILENT = r"rank 3 \(pipeline stage 1, tensor rank 1\) on host \S+ \(pid \d+\).*stopped answering"
HUNG = r"no answer within worker_timeout=15s while step \d+ from worker .*rank 3 \(pipeline stage 1, tensor rank 1\) " \
       r"on host \S+ \(pid \d+\): one of them is hung"


@pytest.mark.slow
@pytest.mark.parametrize("mode,how,error", [("forever", signal.SIGKILL, SILENT), ("forever", signal.SIGSTOP, SILENT),
                                            ("hang", None, HUNG)], ids=["killed", "stopped", "main-thread-hangs"])
def test_dead_or_hung_worker_on_node_1_fails_node_0(mode: str, how: signal.Signals | None, error: str) -> None:
    """Rank 3 dies, is stopped (its heartbeat stops too) or hangs in a step while its
    heartbeat thread beats on: node 0 names it within worker_timeout (15 s)."""
    nodes = _launch([JOB, mode, "2", "2"])
    try:
        deadline = time.monotonic() + 150
        line = ""
        while not line.startswith("HOSTS ") and time.monotonic() < deadline:
            line = nodes[0].stdout.readline()
            assert line or nodes[0].poll() is None, nodes[0].stderr.read()
        hosts = json.loads(line.removeprefix("HOSTS "))
        pids = [int(re.search(r"pid (\d+)", h).group(1)) for h in hosts]
        if how is not None:
            time.sleep(1.0)
            os.kill(pids[3], how)  # rank 3: node 1, pipeline stage 1, tensor rank 1
        struck = time.monotonic()
        out0 = "".join(nodes[0].communicate(timeout=60))
        code0 = nodes[0].returncode
        elapsed = time.monotonic() - struck
        if how == signal.SIGSTOP:  # let the stopped process run again: it must find the job over and leave
            os.kill(pids[3], signal.SIGCONT)
        (code1, _), = _finish(nodes[1:], timeout=60)
    finally:
        for p in nodes:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    assert code0 != 0 and code1 != 0
    assert re.search(r"WorkerError: .*" + error, out0), out0[-3000:]
    assert elapsed < 15 + 10  # worker_timeout, plus the launcher's own teardown
    time.sleep(0.5)
    assert not [p for p in pids if _alive(p)]


@pytest.mark.parametrize("sizes", [dict(tensor_parallel_size=2, pipeline_parallel_size=2),
                                   dict(tensor_parallel_size=3)])
def test_sizes_that_do_not_fit_the_job_raise_before_joining(monkeypatch, sizes: dict) -> None:
    for name, value in dict(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                            MASTER_PORT="1").items():
        monkeypatch.setenv(name, value)
    match = r"torchrun started 2 processes but .* is 4" if len(sizes) == 2 else r"tensor_parallel_size \(3\)"
    with pytest.raises(ValueError, match=match):
        LLM("tiny", **sizes)


def test_launch_outside_torchrun_says_so(capsys) -> None:
    from sarathi_rt.launch import main

    with pytest.raises(SystemExit):
        main(["--model", "tiny", "--tensor-parallel-size", "2", "generate"])
    assert "run this under torchrun" in capsys.readouterr().err


class _Store:
    """The three calls of a torch.distributed store that the configuration hand-over uses."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    def set(self, key: str, value: bytes) -> None:
        self.data[key] = value

    def wait(self, keys: list[str]) -> None:
        assert all(k in self.data for k in keys)

    def get(self, key: str) -> bytes:
        return self.data[key]


def test_workers_take_rank_0s_configuration_and_check_the_sizes(emulated_bf16: None) -> None:
    from sarathi_rt.engine import EngineConfig
    from sarathi_rt.engine.distributed.torchrun import _driver_config

    store = _Store()
    driver = EngineConfig(model="tiny", dtype="bfloat16", block_size=8, seed=7, tensor_parallel_size=2,
                          pipeline_parallel_size=2)
    assert _driver_config(store, 0, driver) is driver
    assert _driver_config(store, 3, EngineConfig(model="tiny", tensor_parallel_size=2,
                                                 pipeline_parallel_size=2)) == driver
    with pytest.raises(ValueError, match=r"rank 0 runs .* 2 x 2, rank 1 was started with 4 x 1"):
        _driver_config(store, 1, EngineConfig(model="tiny", tensor_parallel_size=4))
