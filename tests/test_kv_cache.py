from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from sarathi_rt import ops
from sarathi_rt.ops.kv_cache import KVCache, KVCacheShape

LLAMA3_8B = KVCacheShape(num_layers=32, block_size=16, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)


@pytest.mark.parametrize("field", ["num_layers", "block_size", "num_kv_heads", "head_dim"])
@pytest.mark.parametrize("value", [0, -3, 2.5, "16", True])
def test_shape_fields_must_be_positive_ints(field: str, value: object) -> None:
    fields = {"num_layers": 2, "block_size": 16, "num_kv_heads": 2, "head_dim": 64, field: value}
    with pytest.raises(ValueError, match=f"{field} must be a positive int"):
        KVCacheShape(**fields)


def test_shape_dtype_must_be_a_storage_dtype() -> None:
    with pytest.raises(TypeError, match="dtype must be float32, float16 or bfloat16"):
        KVCacheShape(num_layers=1, block_size=16, num_kv_heads=1, head_dim=64, dtype=torch.float64)


def test_bytes_per_block_counts_k_and_v_of_every_layer() -> None:
    # 2 (K, V) x 32 layers x 16 tokens x 8 heads x 128 dims x 2 bytes = 2 MiB.
    assert LLAMA3_8B.bytes_per_block == 2 * 1024 * 1024
    fp32 = KVCacheShape(num_layers=1, block_size=1, num_kv_heads=1, head_dim=1)
    assert fp32.bytes_per_block == 8


def test_blocks_for_memory() -> None:
    assert LLAMA3_8B.blocks_for_memory(40 * 1024**3) == 20480
    assert LLAMA3_8B.blocks_for_memory(2 * 1024 * 1024 - 1) == 0
    assert LLAMA3_8B.blocks_for_memory(0) == 0
    with pytest.raises(ValueError, match="budget_bytes must be >= 0"):
        LLAMA3_8B.blocks_for_memory(-1)


@given(budget=st.integers(0, 1 << 40), block_size=st.integers(1, 64), heads=st.integers(1, 16))
def test_blocks_for_memory_is_the_most_that_fit(budget: int, block_size: int, heads: int) -> None:
    shape = KVCacheShape(num_layers=3, block_size=block_size, num_kv_heads=heads, head_dim=64, dtype=torch.float16)
    n = shape.blocks_for_memory(budget)
    assert n * shape.bytes_per_block <= budget < (n + 1) * shape.bytes_per_block


def test_cache_tensors_have_the_paged_layout() -> None:
    shape = KVCacheShape(num_layers=3, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float16)
    cache = KVCache(shape, num_blocks=5)
    assert len(cache.k) == len(cache.v) == 3
    for k, v in (cache.layer(i) for i in range(3)):
        assert k.shape == v.shape == (5, 4, 2, 8)
        assert k.dtype == v.dtype == torch.float16 and k.device.type == "cpu"
        assert k.is_contiguous() and k.data_ptr() != v.data_ptr()
    assert cache.nbytes == sum(t.nbytes for t in cache.k + cache.v) == 5 * shape.bytes_per_block


def test_cache_layers_work_with_write_kv() -> None:
    cache = KVCache(KVCacheShape(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8), num_blocks=3)
    before = cache.k[0].clone()
    key, value = torch.randn(2, 5, 2, 8)
    ops.write_kv(key, value, *cache.layer(1), torch.arange(5) + 4)
    assert torch.equal(cache.k[1][1], key[:4]) and torch.equal(cache.v[1][2, 0], value[4])
    assert torch.equal(cache.k[0].view(torch.int32), before.view(torch.int32))  # layer 0 untouched, bit for bit


@pytest.mark.parametrize("num_blocks", [0, -1])
def test_cache_needs_at_least_one_block(num_blocks: int) -> None:
    with pytest.raises(ValueError, match="num_blocks must be >= 1"):
        KVCache(KVCacheShape(num_layers=1, block_size=4, num_kv_heads=1, head_dim=8), num_blocks=num_blocks)
