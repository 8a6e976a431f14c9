"""Everything an engine is built from, checked once."""
from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from sarathi_rt.models import ModelConfig, parse_dtype
from sarathi_rt.scheduler.qos import QoSClass, check_qos_settings
from sarathi_rt.utils.cpu import bf16_forced, cpu_dtype, cpu_flags
from sarathi_rt.utils.dtypes import DTypeLike, cuda_dtype, dtype_name

log = logging.getLogger("sarathi_rt")


DEFAULT_MAX_NUM_SEQS = 128


def _positive(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


@dataclass(frozen=True)
class EngineConfig:
    """model: a Hugging Face directory or a preset name (tiny, cpu-small, llama3-8b).
    dtype None: on the CPU bfloat16 where it has native BF16 (AVX512-BF16 or AMX), else
    float32; an explicit bfloat16 on a CPU without it runs float32 with a warning unless
    SARATHI_RT_CPU_BF16=emulate (the rule: sarathi_rt.utils.cpu); on CUDA bfloat16 from
    SM 8.0, float16 before (utils.dtypes.cuda_dtype: the kernels take no float32).
    chunk_size None means the token budget. max_num_seqs None means
    min(DEFAULT_MAX_NUM_SEQS, token_budget) (a step carries every running decode).
    num_kv_blocks None sizes the cache for what max_num_seqs full-length requests can
    use, capped by kv_memory_fraction of free memory (0.9 of free GPU memory; on the CPU
    0.5 of MemAvailable and at most 4 GiB, see engine.memory). tile_size:
    None, an int, or "auto" (the GEMM tile the ops choose for this model, if any).
    max_model_len None means the model's max_position_embeddings. seed picks the random
    weights of a preset and the seeds of requests that bring none.

    tensor_parallel_size x pipeline_parallel_size > 1 runs the model in that many worker
    processes (one GPU each on CUDA); worker_timeout (seconds) bounds every wait on them,
    so a hung worker raises instead of hanging the engine.

    tbt_slo (seconds) turns on the adaptive token budget (policy sarathi): each step's
    prefill is sized so that its time, as an online step-time model learned from the
    engine's own steps predicts it, stays within the SLO; token_budget is then the cap.
    With pipeline_parallel_size > 1 a step is a micro-batch and the model learns its
    time from submission to output, the gap its requests see between two tokens.
    enable_prefix_caching: requests share the KV blocks of prompt prefixes computed
    before (outputs are the same with it on or off; see the README).
    qos_classes / default_qos / qos_policy: QoS classes with deadlines, as
    SchedulerConfig's; a request names its class in add_request(qos=). The deadline
    policy sizes steps with the same online step-time model as tbt_slo. Outputs are the
    same with and without classes (only order and timing move)."""

    model: str | Path
    device: str | torch.device = "cpu"
    dtype: DTypeLike | None = None
    policy: str = "sarathi"
    token_budget: int = 512
    chunk_size: int | None = None
    max_num_seqs: int | None = None
    block_size: int = 16
    num_kv_blocks: int | None = None
    tile_size: int | str | None = None
    seed: int = 0
    max_model_len: int | None = None
    kv_memory_fraction: float | None = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    worker_timeout: float = 300.0
    tbt_slo: float | None = None
    enable_prefix_caching: bool = True
    qos_classes: Mapping[str, QoSClass] | None = None
    default_qos: str | None = None
    qos_policy: str = "deadline"

    def __post_init__(self) -> None:
        if self.max_num_seqs is None and isinstance(self.token_budget, int):
            object.__setattr__(self, "max_num_seqs", min(DEFAULT_MAX_NUM_SEQS, self.token_budget))
        if not isinstance(self.model, (str, Path)) or not str(self.model):
            raise ValueError(f"model must be a directory path or a preset name, got {self.model!r}")
        try:
            device = torch.device(self.device)
        except (RuntimeError, TypeError):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}") from None
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device is {self.device!r} but no CUDA device is available")
        object.__setattr__(self, "device", device)
        object.__setattr__(self, "dtype", _compute_dtype(self.dtype, device))
        for name in ("token_budget", "max_num_seqs", "block_size", "tensor_parallel_size",
                     "pipeline_parallel_size"):
            _positive(name, getattr(self, name))
        for name in ("chunk_size", "num_kv_blocks", "max_model_len"):
            if getattr(self, name) is not None:
                _positive(name, getattr(self, name))
        if self.tile_size is not None and self.tile_size != "auto":
            _positive("tile_size", self.tile_size)
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0:
            raise ValueError(f"seed must be an int >= 0, got {self.seed!r}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be a bool, got {self.enable_prefix_caching!r}")
        object.__setattr__(self, "qos_classes", check_qos_settings(self.qos_classes, self.default_qos,
                                                                   self.qos_policy))
        if self.kv_memory_fraction is not None and not 0 < self.kv_memory_fraction <= 1:
            raise ValueError(f"kv_memory_fraction must be in (0, 1], got {self.kv_memory_fraction!r}")
        if isinstance(self.worker_timeout, bool) or not isinstance(self.worker_timeout, (int, float)) \
                or not self.worker_timeout > 0:
            raise ValueError(f"worker_timeout must be a positive number of seconds, got {self.worker_timeout!r}")
        world = self.world_size
        if device.type == "cuda" and world > 1 and world > torch.cuda.device_count():
            raise ValueError(f"tensor_parallel_size x pipeline_parallel_size ({world}) exceeds the "
                             f"{torch.cuda.device_count()} CUDA devices")

    @property
    def world_size(self) -> int:
        """Worker processes: one per (tensor rank, pipeline stage)."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def model_len(self, model_config: ModelConfig) -> int:
        """The longest sequence (prompt + generated) a request may reach."""
        limit = model_config.max_position_embeddings
        if self.max_model_len is None:
            return limit
        if self.max_model_len > limit:
            raise ValueError(f"max_model_len ({self.max_model_len}) exceeds the model's "
                             f"max_position_embeddings ({limit})")
        return self.max_model_len


def _compute_dtype(dtype: DTypeLike | None, device: torch.device) -> torch.dtype:
    """The dtype the engine computes in: `dtype` checked, on CUDA one its kernels take, and
    on the CPU chosen by the BF16 rule (warning once here, once per engine, when bf16 falls back to float32)."""
    requested = None if dtype is None else dtype_name(parse_dtype(dtype))
    if device.type == "cuda":
        return parse_dtype(cuda_dtype(requested, torch.cuda.get_device_capability(device)))
    name, warning = cpu_dtype(requested, cpu_flags(), bf16_forced())
    if warning is not None:
        log.warning(warning)
    return parse_dtype(name)
