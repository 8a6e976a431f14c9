"""Dtypes are accepted as torch dtypes or names everywhere in the public API, through
one parse function, and a wrong one raises naming the argument."""
import pytest
import torch

from sarathi_rt import ops
from sarathi_rt.utils.dtypes import cuda_dtype, parse_dtype
from sarathi_rt.config import EngineConfig
from sarathi_rt.ops.kv_cache import KVCacheShape


@pytest.mark.parametrize(("spelling", "want"), [
    ("float32", torch.float32), ("fp32", torch.float32), ("float", torch.float32), ("torch.float32", torch.float32),
    ("float16", torch.float16), ("fp16", torch.float16), ("half", torch.float16), ("FP16", torch.float16),
    ("bfloat16", torch.bfloat16), ("bf16", torch.bfloat16), ("torch.bfloat16", torch.bfloat16),
    (torch.bfloat16, torch.bfloat16),
])
def test_names_and_dtypes_resolve_to_the_torch_dtype(spelling, want) -> None:
    assert parse_dtype(spelling) is want


def test_bad_dtypes_name_the_argument() -> None:
    with pytest.raises(ValueError, match="kv_dtype must be float32, float16 or bfloat16.*'bfloat61'"):
        parse_dtype("bfloat61", "kv_dtype")
    with pytest.raises(TypeError, match="dtype must be float32, float16 or bfloat16, got float64"):
        parse_dtype("float64")
    with pytest.raises(TypeError, match="dtype must be .* got int8"):
        parse_dtype(torch.int8)
    with pytest.raises(TypeError, match="got int"):
        parse_dtype(16)
    assert parse_dtype("double", allowed=(torch.float32, torch.float64)) is torch.float64


def test_public_entry_points_take_names(emulated_bf16: None) -> None:
    shape = KVCacheShape(num_layers=2, block_size=16, num_kv_heads=2, head_dim=64, dtype="bf16")
    assert shape == KVCacheShape(2, 16, 2, 64, torch.bfloat16) and shape.bytes_per_block == 2 * 2 * 16 * 2 * 64 * 2
    assert EngineConfig(model="tiny", dtype="half").dtype is torch.float16
    assert EngineConfig(model="tiny", dtype=torch.bfloat16).dtype is torch.bfloat16
    cache = ops.rope_cos_sin_cache(8, 4, 10000.0, dtype="float64")
    assert cache.dtype is torch.float64 and torch.equal(cache, ops.rope_cos_sin_cache(8, 4, 10000.0, dtype=torch.float64))
    with pytest.raises(TypeError, match="dtype must be float32 or float64, got float16"):
        ops.rope_cos_sin_cache(8, 4, 10000.0, dtype="fp16")
    plan = ops.AttentionPlan(max_batch=2, max_tokens=8, num_q_heads=2, num_kv_heads=1, head_dim=64, device="cpu",
                             dtype="bfloat16", num_ctas=4)
    assert plan.dtype is torch.bfloat16


@pytest.mark.parametrize("capability,expected", [((9, 0), "bfloat16"), ((8, 0), "bfloat16"), ((12, 0), "bfloat16"),
                                                 ((7, 5), "float16"), ((7, 0), "float16")])
def test_cuda_default_dtype_is_one_the_kernels_take(capability: tuple[int, int], expected: str) -> None:
    assert cuda_dtype(None, capability) == expected
    assert cuda_dtype("float16", capability) == "float16"


@pytest.mark.parametrize("requested", ["float32", "float64"])
def test_cuda_refuses_a_dtype_the_kernels_do_not_take(requested: str) -> None:
    with pytest.raises(ValueError, match=f"dtype must be float16 or bfloat16 on CUDA .*got '{requested}'"):
        cuda_dtype(requested, (9, 0))


@pytest.mark.parametrize("capability,expected", [((9, 0), torch.bfloat16), ((7, 5), torch.float16)])
def test_engine_config_resolves_cuda_defaults_without_a_gpu(monkeypatch: pytest.MonkeyPatch,
                                                            capability: tuple[int, int], expected: torch.dtype) -> None:
    """LLM(model, device="cuda") with no dtype: what the engine would run on such a GPU
    (it used to default to float32, which the CUDA attention kernel refuses at warm-up)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert EngineConfig(model="tiny", device="cuda").dtype is expected
    with pytest.raises(ValueError, match="dtype must be float16 or bfloat16 on CUDA"):
        EngineConfig(model="tiny", device="cuda", dtype="float32")
