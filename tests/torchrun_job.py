"""Run by tests/test_torchrun.py on every rank of a two-node torchrun job (not a test):
    torchrun_job.py generate TP PP   greedy tokens of PROMPTS on rank 0, as JSON; at exit, every
                                     rank prints the package's threads still alive (none may be:
                                     one inside a store call aborts the interpreter's exit)
    torchrun_job.py forever TP PP    print each rank's host and pid, then keep generating
    torchrun_job.py hang TP PP       as forever, but the last rank's main thread hangs in its
                                     third step (its heartbeat thread keeps beating)"""
from __future__ import annotations

import atexit
import json
import os
import sys
import threading
import time

from sarathi_rt import LLM, SamplingParams

PROMPTS = [[5, 6, 7], list(range(10, 50)), [3] * 17, [200, 100, 9, 8]]
PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
ENGINE = dict(block_size=8, num_kv_blocks=64, token_budget=24, chunk_size=16, max_num_seqs=8)


def hang_in_third_step() -> None:
    from sarathi_rt.engine.distributed.process import PipelineStage

    run, calls = PipelineStage.run, []

    def hanging(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            time.sleep(3600)
        return run(self, *args, **kwargs)

    PipelineStage.run = hanging


def print_live_threads() -> None:
    names = [t.name for t in threading.enumerate() if t.name.startswith("sarathi-rt")]
    print(f"THREADS rank {os.environ['RANK']}: {json.dumps(names)}", flush=True)


def main(mode: str, tp: int, pp: int) -> None:
    if mode == "generate":
        atexit.register(print_live_threads)
    if mode == "hang" and int(os.environ["RANK"]) == tp * pp - 1:
        hang_in_third_step()
    with LLM("tiny", tensor_parallel_size=tp, pipeline_parallel_size=pp, worker_timeout=15, **ENGINE) as llm:
        if mode == "generate":
            outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
            print("TOKENS " + json.dumps([list(o.token_ids) for o in outs]), flush=True)
            return
        print("HOSTS " + json.dumps(llm.engine.executor.hosts), flush=True)
        while True:
            llm.generate(PROMPTS, PARAMS, use_tqdm=False)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
