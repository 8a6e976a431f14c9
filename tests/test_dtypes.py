"""Dtypes are accepted as torch dtypes or names everywhere in the public API, through
one parse function, and a wrong one raises naming the argument."""
import pytest
import torch

from sarathi_rt import ops
from sarathi_rt.utils.dtypes import parse_dtype
from sarathi_rt.engine.config import EngineConfig
from sarathi_rt.engine.kv_cache import KVCacheShape


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
