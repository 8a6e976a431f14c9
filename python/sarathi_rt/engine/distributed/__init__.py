"""Tensor and pipeline parallelism: worker processes on torch.distributed (gloo on CPU,
NCCL on GPUs), driven by one executor in the engine's process."""
from .executor import MultiprocessExecutor, WorkerError
from .topology import Topology

__all__ = ["MultiprocessExecutor", "Topology", "WorkerError"]
