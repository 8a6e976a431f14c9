from __future__ import annotations

import math

import pytest
import torch

from sarathi_rt import ops

from conftest import requires_cuda

# Llama-3-8B projections (N, K): qkv, o, gate_up, down; and the cpu-small preset's.
LLAMA3_8B = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]
CPU_SMALL = [(768, 512), (512, 512), (3072, 512), (512, 1536), (32000, 512)]
TARGETS = [(80, 108), (90, 132)]  # A100, H100/H200
REGULAR = [c["name"] for c in ops.gemm_tile_configs() if not c["swap_ab"]]
SMALL_M = [c["name"] for c in ops.gemm_tile_configs() if c["swap_ab"]]


def _plan(m: int, n: int, k: int, **kw) -> ops.GemmPlan:
    return ops.gemm_plan(m, n, k, torch.bfloat16, "cpu", **kw)


@pytest.mark.parametrize("config", REGULAR)
@pytest.mark.parametrize("n,k", LLAMA3_8B)
def test_m_257_needs_more_ctas_than_256(config: str, n: int, k: int) -> None:
    p256, p257 = _plan(256, n, k, config=config, split_k=1), _plan(257, n, k, config=config, split_k=1)
    assert p257.tiles_m == p256.tiles_m + 1
    assert p257.ctas > p256.ctas
    assert p257.padded_m - p256.padded_m == p256.tile_m


@pytest.mark.parametrize("arch,num_sms", TARGETS)
@pytest.mark.parametrize("n,k", LLAMA3_8B)
def test_planner_sees_the_stair_at_257(arch: int, num_sms: int, n: int, k: int) -> None:
    p256 = _plan(256, n, k, arch=arch, num_sms=num_sms)
    p257 = _plan(257, n, k, arch=arch, num_sms=num_sms)
    assert p256.tile_efficiency == 1.0 and p257.tile_efficiency < 1.0
    assert p257.efficiency < p256.efficiency


@pytest.mark.parametrize("config", REGULAR + SMALL_M)
@pytest.mark.parametrize("n,k", LLAMA3_8B + CPU_SMALL)
def test_a_tile_multiple_never_needs_padding(config: str, n: int, k: int) -> None:
    tile_m = _plan(1, n, k, config=config).tile_m
    for tiles in (1, 2, 3, 7, 16, 33):
        p = _plan(tiles * tile_m, n, k, config=config)
        assert p.padded_m == tiles * tile_m and p.tiles_m == tiles
        one_more = _plan(tiles * tile_m + 1, n, k, config=config)
        assert one_more.padded_m == (tiles + 1) * tile_m


@pytest.mark.parametrize("arch,num_sms", TARGETS)
def test_small_m_picks_a_small_m_config(arch: int, num_sms: int) -> None:
    for m in (1, 2, 8, 17, 64):
        plan = _plan(m, 4096, 4096, arch=arch, num_sms=num_sms)
        assert plan.swap_ab and plan.config in SMALL_M
        assert plan.tile_m <= 32  # the tokens sit in the small tile
    assert not _plan(65, 4096, 4096, arch=arch, num_sms=num_sms).swap_ab


@pytest.mark.parametrize("arch,num_sms", TARGETS)
@pytest.mark.parametrize("n,k", LLAMA3_8B)
def test_plan_fields_are_consistent_and_the_choice_is_the_best(arch: int, num_sms: int, n: int, k: int) -> None:
    for m in (1, 16, 64, 65, 100, 256, 257, 1000, 4096):
        p = _plan(m, n, k, arch=arch, num_sms=num_sms)
        assert p.tiles_m == math.ceil(m / p.tile_m) and p.tiles_n == math.ceil(n / p.tile_n)
        assert p.ctas == p.tiles_m * p.tiles_n * p.split_k
        assert p.waves == math.ceil(p.ctas / (num_sms * p.ctas_per_sm))
        assert 0 < p.wave_efficiency <= 1 and 0 < p.tile_efficiency <= 1 and 0 < p.efficiency < 1
        assert p.efficiency <= p.tile_efficiency * p.wave_efficiency + 1e-12
        candidates = SMALL_M if m <= 64 else REGULAR
        for config in candidates:
            forced = _plan(m, n, k, arch=arch, num_sms=num_sms, config=config)
            assert forced.efficiency <= p.efficiency + 1e-12


def test_wave_quantization_shows_in_the_last_wave() -> None:
    # 128x128 tiles of a 4096-wide output: 32 per tile row. 108 SMs x 1 CTA per SM.
    plans = {m: _plan(m, 4096, 4096, config="128x128x64_s4", split_k=1) for m in (384, 512)}
    assert plans[384].ctas == 96 and plans[384].waves == 1
    assert plans[512].ctas == 128 and plans[512].waves == 2
    assert plans[512].wave_efficiency == pytest.approx(128 / 216)


def test_more_sms_never_need_more_waves() -> None:
    for m in (64, 300, 2048):
        assert _plan(m, 6144, 4096, arch=90, num_sms=132).waves <= _plan(m, 6144, 4096, arch=90, num_sms=66).waves


@pytest.mark.parametrize("n,k", LLAMA3_8B + CPU_SMALL)
def test_gemm_tile_size_is_the_large_m_tile(n: int, k: int) -> None:
    size = ops.gemm_tile_size(n, k, torch.bfloat16, "cpu")
    assert size == _plan(4096, n, k).tile_m
    assert size in (64, 128)
    assert ops.gemm_tile_size(n, k, torch.float32, "cpu") == size


def test_gemm_plan_bad_inputs_name_the_argument() -> None:
    with pytest.raises(ValueError, match="M must be a positive int"):
        ops.gemm_plan(0, 8, 8, torch.float16)
    with pytest.raises(ValueError, match="N must be a positive int"):
        ops.gemm_plan(8, -1, 8, torch.float16)
    with pytest.raises(ValueError, match="K must be a positive int"):
        ops.gemm_plan(8, 8, 2.5, torch.float16)
    with pytest.raises(TypeError, match="dtype"):
        ops.gemm_plan(8, 8, 8, torch.int32)
    with pytest.raises(ValueError, match="dtype must be float32, float16 or bfloat16"):
        ops.gemm_plan(8, 8, 8, "int4")
    assert ops.gemm_plan(8, 8, 8, "bf16") == ops.gemm_plan(8, 8, 8, torch.bfloat16)
    with pytest.raises(ValueError, match="device"):
        ops.gemm_plan(8, 8, 8, torch.float16, "tpu")
    with pytest.raises(ValueError, match="num_sms"):
        ops.gemm_plan(8, 8, 8, torch.float16, num_sms=0)
    with pytest.raises(ValueError, match="arch 70 is not supported"):
        ops.gemm_plan(8, 8, 8, torch.float16, arch=70)
    with pytest.raises(ValueError, match="config must be one of"):
        ops.gemm_plan(8, 8, 8, torch.float16, config="256x256")
    with pytest.raises(ValueError, match="split_k must be in"):
        ops.gemm_plan(8, 8, 8, torch.float16, split_k=9)


@requires_cuda
def test_gemm_plan_on_cuda_uses_the_device_sm_count() -> None:
    props = torch.cuda.get_device_properties(0)
    plan = ops.gemm_plan(1024, 4096, 4096, torch.bfloat16, "cuda")
    assert plan.num_sms == props.multi_processor_count
    assert plan.arch == props.major * 10 + props.minor


def test_dtype_may_be_named() -> None:
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        name = str(dtype).removeprefix("torch.")
        assert ops.gemm_plan(100, 4096, 4096, name) == ops.gemm_plan(100, 4096, 4096, dtype)
    assert ops.gemm_tile_size(4096, 4096, "bfloat16") == ops.gemm_tile_size(4096, 4096, torch.bfloat16)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error of a host without CUDA")
def test_cuda_plan_without_a_gpu_asks_for_arch_and_num_sms() -> None:
    for kw in ({}, {"arch": 90}, {"num_sms": 132}):
        with pytest.raises(ValueError, match="pass arch= and num_sms="):
            ops.gemm_plan(64, 4096, 4096, "bfloat16", device="cuda", **kw)
    plan = ops.gemm_plan(64, 4096, 4096, "bfloat16", device="cuda:0", arch=90, num_sms=132)
    assert (plan.arch, plan.num_sms) == (90, 132)
    assert plan == ops.gemm_plan(64, 4096, 4096, "bfloat16", "cpu", arch=90, num_sms=132)


# CTAs per SM of each configuration on an A100 (sm80: 164 KiB shared memory per SM) and
# an H100/H200 (sm90: 228 KiB), 1 KiB reserved per CTA. Set by shared memory alone once
# the kernels' registers allow it, as they do: e.g. the 64x16 decode tile uses 40 KiB,
# so 4 fit on sm80 and 5 on sm90, where 255 registers a thread would allow only 2.
CTAS_PER_SM = {
    "128x256x64_s3": (1, 1), "128x128x64_s4": (1, 1), "64x128x64_s4": (1, 2),
    "swap_128x32x64_s4": (2, 2), "swap_64x16x64_s4": (4, 5),
}


@pytest.mark.parametrize("config", sorted(CTAS_PER_SM))
def test_ctas_per_sm_are_the_kernels_limits(config: str) -> None:
    for (arch, num_sms), expected in zip(TARGETS, CTAS_PER_SM[config]):
        plan = _plan(16, 4096, 4096, arch=arch, num_sms=num_sms, config=config, split_k=1)
        assert plan.ctas_per_sm == expected, (arch, plan.registers)
        assert 0 < plan.registers <= 255


def test_decode_waves_use_the_real_occupancy() -> None:
    # 4096 outputs in 64-row tiles with 8 K slices: 512 CTAs, one wave at 5 CTAs per SM on
    # 132 SMs (two at the 2 per SM a 255-register assumption gives).
    plan = _plan(8, 4096, 4096, arch=90, num_sms=132, config="swap_64x16x64_s4", split_k=8)
    assert plan.ctas == 512 and plan.ctas_per_sm == 5 and plan.waves == 1


def test_split_k_workspace_holds_a_float32_sum() -> None:
    plan = _plan(16, 4096, 4096, config="swap_64x16x64_s4", split_k=4)
    assert plan.workspace_bytes == 4 * 16 * 4096 + 4 * plan.tiles_m * plan.tiles_n
    assert _plan(16, 4096, 4096, config="swap_64x16x64_s4", split_k=1).workspace_bytes == 0


@requires_cuda
@pytest.mark.parametrize("config", [c["name"] for c in ops.gemm_tile_configs()])
def test_ctas_per_sm_match_the_driver(config: str) -> None:
    from sarathi_rt import _C
    from sarathi_rt.ops._checks import DTYPE_CODES

    plan = ops.gemm_plan(16, 4096, 4096, torch.bfloat16, "cuda", config=config, split_k=1)
    for dtype in (torch.bfloat16, torch.float16):
        for split_k in (False, True):
            driver = _C.gemm_kernel_occupancy(plan.config_id, DTYPE_CODES[dtype], split_k, 0)
            assert driver["ctas_per_sm"] == plan.ctas_per_sm, (dtype, split_k, driver)
            assert driver["registers"] <= plan.registers
