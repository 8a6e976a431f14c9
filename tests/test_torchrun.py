"""Two nodes on one machine: two torchrun invocations on 127.0.0.1 (--nnodes 2
--nproc-per-node 2, gloo) give the single process's greedy tokens with TP=2 x PP=2 and
with TP=4 over 2 KV heads; a worker killed on node 1 fails node 0 with an error naming
it within the timeout, and every process of the job ends."""
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


def _launch(args: list[str]) -> list[subprocess.Popen]:
    port = str(_free_port())
    # The workers import sarathi_rt from where this process did (an install, or python/ in
    # a development tree), not from the checkout's sources, which may hold no built core.
    package_root = str(Path(sarathi_rt.__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([package_root, os.environ.get("PYTHONPATH", "")]))
    return [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
                              "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", port,
                              JOB, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                             start_new_session=True) for node in (0, 1)]


def _finish(nodes: list[subprocess.Popen], timeout: float) -> list[tuple[int, str]]:
    try:
        outputs = ["".join(p.communicate(timeout=timeout)) for p in nodes]
        return [(p.returncode, out) for p, out in zip(nodes, outputs)]
    finally:
        for p in nodes:  # a hung job must not outlive the test
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    with LLM("tiny", **ENGINE) as llm:
        return [list(o.token_ids) for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp", [(2, 2), (4, 1)], ids=["tp2-pp2", "tp4-kv-replicated"])
def test_two_nodes_match_one_process(reference, tp: int, pp: int) -> None:
    (code0, out0), (code1, out1) = _finish(_launch(["generate", str(tp), str(pp)]), timeout=150)
    assert code0 == 0 and code1 == 0, out0 + out1
    tokens = re.search(r"TOKENS (.*)", out0)
    assert tokens is not None, out0
    assert json.loads(tokens.group(1)) == reference
    assert "TOKENS" not in out1  # only world rank 0 drives


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.slow
def test_killed_worker_on_node_1_fails_node_0() -> None:
    nodes = _launch(["forever", "2", "2"])
    try:
        deadline = time.monotonic() + 150
        line = ""
        while not line.startswith("HOSTS ") and time.monotonic() < deadline:
            line = nodes[0].stdout.readline()
            assert line or nodes[0].poll() is None, nodes[0].stderr.read()
        hosts = json.loads(line.removeprefix("HOSTS "))
        pids = [int(re.search(r"pid (\d+)", h).group(1)) for h in hosts]
        time.sleep(1.0)
        os.kill(pids[3], signal.SIGKILL)  # rank 3: node 1, pipeline stage 1, tensor rank 1
        killed = time.monotonic()
        (code0, out0), (code1, _) = _finish(nodes, timeout=60)
        elapsed = time.monotonic() - killed
    finally:
        for p in nodes:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    assert code0 != 0 and code1 != 0
    assert re.search(r"WorkerError: worker .*rank 3 \(pipeline stage 1, tensor rank 1\) on host \S+ \(pid \d+\)"
                     r".*stopped answering", out0), out0[-3000:]
    assert elapsed < 15 + 10  # worker_timeout, plus the launchers' own teardown
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
