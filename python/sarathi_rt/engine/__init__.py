"""The serving engine: a driver (LLMEngine: scheduler, requests, outputs, metrics) that
hands plain StepInputs to an executor of workers (model, the paged KV cache of
`kv_cache`, the runner that builds each step's context once, the sampler), in process or
in worker processes (`distributed`)."""
from .async_engine import AsyncLLMEngine
from sarathi_rt.config import EngineConfig
from .executor import Executor, InProcessExecutor
from .llm_engine import LLMEngine
from .model_runner import ModelRunner
from .outputs import RequestOutput
from .sampler import Sampler
from .step_io import RowSampling, SequenceChunk, StepInput, StepOutput
from .worker import Worker

__all__ = ["AsyncLLMEngine", "EngineConfig", "Executor", "InProcessExecutor", "LLMEngine", "ModelRunner",
           "RequestOutput", "RowSampling", "Sampler", "SequenceChunk", "StepInput", "StepOutput", "Worker"]
