"""Which CUTLASS tile configuration a linear layer's GEMM uses, and what the tile and wave
quantization cost it: the planner is C++ (csrc/cpu/gemm_plan.cpp), shared with the CUDA
launcher, so what it reports is what runs."""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from sarathi_rt import _C
from sarathi_rt.utils.checks import positive_int
from sarathi_rt.utils.dtypes import parse_dtype
from sarathi_rt.ops._checks import DTYPE_CODES

# With no GPU to ask (device="cpu"), plans are made for the paper's device, an A100.
DEFAULT_ARCH = 80
DEFAULT_NUM_SMS = 108
# gemm_tile_size plans at this many tokens: a big prefill batch, past the small-M kernels.
LARGE_M = 4096


@dataclass(frozen=True)
class GemmPlan:
    """The GEMM y[M, N] = x[M, K] @ w[N, K]^T as the planner lays it out.

    tile_m/tile_n are in the problem's M (tokens) and N, also for the swap_ab
    (decode-heavy) configurations, which compute y^T = w x^T so few tokens fill a small
    tile instead of a 128-row one. ctas = tiles_m * tiles_n * split_k; waves = ceil(ctas /
    (num_sms * ctas_per_sm)), where ctas_per_sm is the occupancy of the kernel's own
    registers per thread (`registers`, from ptxas: see build_info()["gemm_registers"]),
    shared memory and threads. efficiency = tile_efficiency * wave_efficiency * the
    configuration's sustained share of peak (and the split-K cost): an estimate.
    workspace_bytes is what the CUDA GEMM needs (split-K sums its K slices in float32).
    """

    m: int
    n: int
    k: int
    dtype: torch.dtype
    arch: int
    num_sms: int
    config: str
    config_id: int
    swap_ab: bool
    tile_m: int
    tile_n: int
    tile_k: int
    stages: int
    split_k: int
    tiles_m: int
    tiles_n: int
    ctas: int
    registers: int
    ctas_per_sm: int
    waves: int
    tile_efficiency: float
    wave_efficiency: float
    efficiency: float
    workspace_bytes: int

    @property
    def padded_m(self) -> int:
        """M rounded up to whole tiles: the rows the GPU computes."""
        return self.tiles_m * self.tile_m


def gemm_tile_configs() -> list[dict]:
    """The explicit set of tile configurations the planner chooses from."""
    return list(_C.gemm_tile_configs())


def _target(device: str | torch.device, arch: int | None, num_sms: int | None) -> tuple[int, int]:
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}") from err
    if dev.type == "cpu":
        default_arch, default_sms = DEFAULT_ARCH, DEFAULT_NUM_SMS
    elif dev.type != "cuda":
        raise ValueError(f"device must be a cpu or cuda device, got {dev}")
    elif arch is not None and num_sms is not None:
        default_arch, default_sms = arch, num_sms  # both given: no device to ask
    elif not torch.cuda.is_available():
        raise ValueError(f"device={str(dev)!r} but this host has no CUDA device to ask for its architecture "
                         "and SM count: pass arch= and num_sms= (e.g. arch=90, num_sms=132 for an H100)")
    else:
        props = torch.cuda.get_device_properties(dev)
        default_arch, default_sms = props.major * 10 + props.minor, props.multi_processor_count
    arch = default_arch if arch is None else positive_int("arch", arch)
    num_sms = default_sms if num_sms is None else positive_int("num_sms", num_sms)
    return arch, num_sms


def gemm_plan(M: int, N: int, K: int, dtype: torch.dtype | str, device: str | torch.device = "cpu", *,
              num_sms: int | None = None, arch: int | None = None, config: str | None = None,
              split_k: int | None = None) -> GemmPlan:
    """Plan y[M, N] = x[M, K] @ w[N, K]^T on `device` (a CUDA device is asked for its SM
    count and architecture; "cpu" plans for an A100: sm80, 108 SMs). dtype is a torch
    dtype or its name ("bfloat16"). num_sms/arch override the device's (a "cuda" plan on
    a host without a GPU needs both); `config` (a name from gemm_tile_configs()) and
    `split_k` (1..8 K slices) force a choice, e.g. for sweeps."""
    for name, value in (("M", M), ("N", N), ("K", K)):
        positive_int(name, value)
    dtype = parse_dtype(dtype, allowed=tuple(DTYPE_CODES))
    arch, num_sms = _target(device, arch, num_sms)
    config_id = -1
    if config is not None:
        by_name = {c["name"]: c["id"] for c in gemm_tile_configs()}
        if config not in by_name:
            raise ValueError(f"config must be one of {sorted(by_name)}, got {config!r}")
        config_id = by_name[config]
    if split_k is not None:
        positive_int("split_k", split_k)
    return _plan(M, N, K, dtype, arch, num_sms, config_id, split_k or 0)


@functools.lru_cache(maxsize=4096)
def _plan(m: int, n: int, k: int, dtype: torch.dtype, arch: int, num_sms: int, config_id: int,
          split_k: int) -> GemmPlan:
    raw = _C.gemm_plan(m, n, k, DTYPE_CODES[dtype], arch, num_sms, config_id, split_k)
    cfg = raw["config"]
    return GemmPlan(m=m, n=n, k=k, dtype=dtype, arch=arch, num_sms=num_sms, config=cfg["name"], config_id=cfg["id"],
                    swap_ab=cfg["swap_ab"], tile_m=raw["tile_m"], tile_n=raw["tile_n"], tile_k=cfg["tile_k"],
                    stages=cfg["stages"], split_k=raw["split_k"], tiles_m=raw["tiles_m"], tiles_n=raw["tiles_n"],
                    ctas=raw["ctas"], registers=raw["registers"], ctas_per_sm=raw["ctas_per_sm"],
                    waves=raw["waves"], tile_efficiency=raw["tile_efficiency"],
                    wave_efficiency=raw["wave_efficiency"], efficiency=raw["efficiency"],
                    workspace_bytes=raw["workspace_bytes"])


def gemm_tile_size(N: int, K: int, dtype: torch.dtype | str, device: str | torch.device = "cpu") -> int:
    """The M (token) tile the GEMM of an [N, K] weight uses for large batches: the unit the
    scheduler aligns a step's token count to."""
    return gemm_plan(LARGE_M, N, K, dtype, device).tile_m
