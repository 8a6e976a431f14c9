"""The engine's config tree: every setting an engine is built from, each declared once
(default, check, help) in the section it belongs to. `EngineConfig` composes the
sections; `LLM(**kwargs)`, `LLMEngine`, `AsyncLLMEngine` and every command take it, and
the commands' flags are built from the same fields (`sarathi_rt.config.flags`)."""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from sarathi_rt.scheduler.config import CacheOptions, SchedulerConfig, SchedulingOptions
from sarathi_rt.utils.checks import boolean, fraction, non_negative_int, positive_int, positive_number
from sarathi_rt.utils.cpu import DTYPE_HELP, bf16_forced, cpu_dtype, cpu_flags
from sarathi_rt.utils.options import option

from .speculative import SpeculativeOptions

if TYPE_CHECKING:
    import torch


class _ModelLimits(Protocol):
    """What model_len reads of a model's config (sarathi_rt.models.ModelConfig, which
    this module does not import: the models import the tree)."""

    max_position_embeddings: int

log = logging.getLogger("sarathi_rt")

DEFAULT_MODEL = "smollm2-135m-instruct"
# How a Hugging Face checkpoint runs: "auto" natively when a family names it, else
# through transformers' model (models/families/transformers_backend); the others force one.
MODEL_IMPLS = ("auto", "native", "transformers")
# How a CPU stage's forward runs: layer loop, eager layers or torch.compile (engine/compiled_forward.py).
COMPILE_MODES = ("auto", "on", "off")


@dataclass(frozen=True, kw_only=True)
class ModelOptions:
    """What runs, and where."""

    SECTION = "model"

    model: str | Path = option(DEFAULT_MODEL, "a named model (smollm2-135m-instruct, fetched on first use), a "
                                              "GGUF file, a Hugging Face directory or a preset with seeded random "
                                              "weights (tiny, tiny-deep, cpu-small, cpu-small-draft, llama3-8b)")
    device: Any = option("cpu", "cpu or cuda[:N]")
    dtype: Any = option(None, DTYPE_HELP, choices=("float32", "bfloat16", "float16"))
    max_model_len: int | None = option(None, "longest sequence (prompt + generated) a request may reach "
                                             "(default: the model's max_position_embeddings)")
    seed: int = option(0, "seeds a preset's random weights and the sampling seed of requests that bring none")
    threads: int | None = option(None, "CPU threads for torch and the kernels (default: torch's)")
    model_impl: str = option("auto", "auto: a native family where one names the checkpoint's architecture, else "
                                     "transformers' model on our KV cache and attention; native or transformers "
                                     "forces one", choices=MODEL_IMPLS)
    trust_remote_code: bool = option(False, "let a Hugging Face directory run modelling code it ships (as in "
                                            "transformers)")
    compile: str = option("auto", "auto: a CPU stage of the plain LLaMA layer runs its layers in the layer loop "
                                  "(kernels and GEMMs called without per-op Python, the same bits as eager), any "
                                  "other eagerly; off: the eager layers; on: the CPU forward under torch.compile "
                                  "(inductor), the step's tokens padded to power-of-two buckets (seconds of "
                                  "start-up, measured slower; docs/cpu.md)", choices=COMPILE_MODES)

    def _check_model(self) -> None:
        import torch

        if not isinstance(self.model, (str, Path)) or not str(self.model):
            raise ValueError(f"model must be a directory path, a GGUF file, a named model or a preset, "
                             f"got {self.model!r}")
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
        if self.max_model_len is not None:
            positive_int("max_model_len", self.max_model_len)
        non_negative_int("seed", self.seed)
        if self.threads is not None:
            positive_int("threads", self.threads)
        if self.model_impl not in MODEL_IMPLS:
            raise ValueError(f"model_impl must be one of {list(MODEL_IMPLS)}, got {self.model_impl!r}")
        boolean("trust_remote_code", self.trust_remote_code)
        if self.compile not in COMPILE_MODES:
            raise ValueError(f"compile must be one of {list(COMPILE_MODES)}, got {self.compile!r}")
        if self.compile == "on" and device.type != "cpu":
            raise ValueError(f"compile='on' runs on the CPU only, but device is {self.device!r}")


@dataclass(frozen=True, kw_only=True)
class MemoryOptions:
    """How much memory the KV cache takes."""

    SECTION = "KV cache size"

    num_kv_blocks: int | None = option(None, "KV cache blocks (default: what max_num_seqs full-length requests "
                                             "can use, capped by kv_memory_fraction of free memory)")
    kv_memory_fraction: float | None = option(None, "share of free memory the KV cache may take (default 0.9 "
                                                    "on a GPU; on the CPU 0.5 of MemAvailable, at most 4 GiB)",
                                              parse=float)

    def _check_memory(self) -> None:
        if self.num_kv_blocks is not None:
            positive_int("num_kv_blocks", self.num_kv_blocks)
        if self.kv_memory_fraction is not None:
            fraction("kv_memory_fraction", self.kv_memory_fraction, closed_low=False, closed_high=True)


@dataclass(frozen=True, kw_only=True)
class ParallelOptions:
    """Worker processes: tensor ranks x pipeline stages (one GPU each on CUDA)."""

    SECTION = "parallelism"

    tensor_parallel_size: int = option(1, "worker processes per pipeline stage (across machines: "
                                          "python -m sarathi_rt.launch)")
    pipeline_parallel_size: int = option(1, "pipeline stages")
    worker_timeout: float = option(300.0, "seconds a worker may keep a step before the engine fails instead "
                                          "of hanging")

    def _check_parallel(self) -> None:
        positive_int("tensor_parallel_size", self.tensor_parallel_size)
        positive_int("pipeline_parallel_size", self.pipeline_parallel_size)
        positive_number("worker_timeout", self.worker_timeout, "seconds")

    @property
    def world_size(self) -> int:
        """Worker processes: one per (tensor rank, pipeline stage)."""
        return self.tensor_parallel_size * self.pipeline_parallel_size


# The sections, in the order help and the docs list them.
SECTIONS = (ModelOptions, SchedulingOptions, CacheOptions, MemoryOptions, ParallelOptions, SpeculativeOptions)


@dataclass(frozen=True, kw_only=True)
class EngineConfig(ModelOptions, SchedulingOptions, CacheOptions, MemoryOptions, ParallelOptions,
                   SpeculativeOptions):
    """Everything an engine is built from, checked once: the fields of the sections above
    (their help: `sarathi-rt serve --help`, or docs/configuration.md). Defaults that
    depend on the device are resolved here: the dtype (the CPU's BF16 rule; bf16 from SM
    8.0 on CUDA, else fp16: the CUDA kernels take no float32) and the adaptive budget's
    cap. With pipeline_parallel_size > 1 a step is a micro-batch and the step-time model
    learns its time from submission to output, the gap its requests see between two
    tokens."""

    def __post_init__(self) -> None:
        self._check_model()
        self._check_scheduling(gpu=self.device.type == "cuda")
        self._check_cache()
        self._check_memory()
        self._check_parallel()
        self._check_speculative(self.policy, self.world_size)
        import torch

        if self.device.type == "cuda" and self.world_size > 1 and self.world_size > torch.cuda.device_count():
            raise ValueError(f"tensor_parallel_size x pipeline_parallel_size ({self.world_size}) exceeds the "
                             f"{torch.cuda.device_count()} CUDA devices")

    def model_len(self, model_config: _ModelLimits) -> int:
        """The longest sequence (prompt + generated) a request may reach."""
        limit = model_config.max_position_embeddings
        if self.max_model_len is None:
            return limit
        if self.max_model_len > limit:
            raise ValueError(f"max_model_len ({self.max_model_len}) exceeds the model's "
                             f"max_position_embeddings ({limit})")
        return self.max_model_len

    def scheduler_config(self, num_blocks: int, tile_size: int | None) -> SchedulerConfig:
        """The scheduler's config: this tree's scheduling and cache sections, the cache's
        size and the resolved tile. A prompt's next chunk waits for its previous one to
        leave the pipeline, so each micro-batch in flight keeps its own partial prompt."""
        shared = {f.name: getattr(self, f.name) for f in dataclasses.fields(SchedulingOptions)}
        shared |= {f.name: getattr(self, f.name) for f in dataclasses.fields(CacheOptions)}
        return SchedulerConfig(**shared | {"tile_size": tile_size}, num_blocks=num_blocks,
                               max_partial_prefills=self.pipeline_parallel_size)


def field_names(*sections: type) -> set[str]:
    return {f.name for s in sections for f in dataclasses.fields(s)}


def _compute_dtype(dtype: object, device: torch.device) -> torch.dtype:
    """The dtype the engine computes in: `dtype` checked, on CUDA one its kernels take, and
    on the CPU chosen by the BF16 rule (warning once here, once per engine, when bf16
    falls back to float32)."""
    import torch

    from sarathi_rt.utils.dtypes import cuda_dtype, dtype_name, parse_dtype

    requested = None if dtype is None else dtype_name(parse_dtype(dtype))  # type: ignore[arg-type]
    if device.type == "cuda":
        return parse_dtype(cuda_dtype(requested, torch.cuda.get_device_capability(device)))
    name, warning = cpu_dtype(requested, cpu_flags(), bf16_forced())
    if warning is not None:
        log.warning(warning)
    return parse_dtype(name)
