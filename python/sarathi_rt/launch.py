"""Run a `sarathi-rt` command on every process of a torchrun job:

    torchrun --nnodes N --nproc-per-node P --node-rank R --master-addr A --master-port Q \\
        -m sarathi_rt.launch --model M --tensor-parallel-size T --pipeline-parallel-size S \\
        {generate,bench,serve} ...

World rank 0 runs the command (the scheduler, the API, the output) with the engine
flags it is given; every other rank serves as a worker with rank 0's engine
configuration and exits when rank 0 is done. N x P must equal T x S."""
from __future__ import annotations

import argparse
import os
import sys

from sarathi_rt import cli
from sarathi_rt.engine.distributed.torchrun import launched_by_torchrun

COMMANDS = ("generate", "bench", "serve")  # the commands that build their engine from --model and the sizes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sarathi_rt.launch", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="Hugging Face directory or preset, the same on every node")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--pipeline-parallel-size", type=int, default=1)
    parser.add_argument("--worker-timeout", type=float, default=300.0, help="seconds any rank may keep a step")
    parser.add_argument("command", choices=COMMANDS)
    args, rest = parser.parse_known_args(argv)
    if not launched_by_torchrun():
        parser.error("run this under torchrun (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT are unset)")
    if int(os.environ["RANK"]) != 0:
        from sarathi_rt.engine import EngineConfig
        from sarathi_rt.engine.distributed import torchrun

        # Joins, serves rank 0's steps with rank 0's configuration, then ends this process.
        torchrun.start(EngineConfig(model=args.model, tensor_parallel_size=args.tensor_parallel_size,
                                    pipeline_parallel_size=args.pipeline_parallel_size,
                                    worker_timeout=args.worker_timeout))
    return cli.main([args.command, "--model", args.model, "--tensor-parallel-size", str(args.tensor_parallel_size),
                     "--pipeline-parallel-size", str(args.pipeline_parallel_size),
                     "--worker-timeout", str(args.worker_timeout), *rest])


if __name__ == "__main__":
    sys.exit(main())
