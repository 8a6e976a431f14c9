from __future__ import annotations

import pytest
import torch

from sarathi_rt import ops
from sarathi_rt.ops import reference

from conftest import requires_cuda

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _case(dtype: torch.dtype, device: str = "cpu", num_tokens: int = 37, block_size: int = 16):
    g = torch.Generator().manual_seed(0)
    heads, dim = 4, 64
    blocks = max(8, 64 // block_size)  # room for every token's slot
    key = torch.randn(num_tokens, heads, dim, generator=g).to(dtype).to(device)
    value = torch.randn(num_tokens, heads, dim, generator=g).to(dtype).to(device)
    slots = torch.randperm(blocks * block_size, generator=g)[:num_tokens]
    slots[::5] = -1  # padding tokens are skipped
    caches = [torch.zeros(blocks, block_size, heads, dim, dtype=dtype, device=device) for _ in range(4)]
    return key, value, slots.to(device), caches


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_write_kv_matches_reference_exactly(dtype: torch.dtype, block_size: int) -> None:
    key, value, slots, (k, v, k_ref, v_ref) = _case(dtype, block_size=block_size)
    ops.write_kv(key, value, k, v, slots)
    reference.write_kv(key, value, k_ref, v_ref, slots)
    assert torch.equal(k, k_ref) and torch.equal(v, v_ref)
    assert k.abs().sum() > 0


def test_write_kv_takes_strided_views_of_a_fused_qkv() -> None:
    qkv = torch.randn(9, 3, 2, 8)  # tokens, (q, k, v), heads, dim
    k = torch.zeros(4, 4, 2, 8)
    v = torch.zeros_like(k)
    slots = torch.arange(9, dtype=torch.int64)
    ops.write_kv(qkv[:, 1], qkv[:, 2], k, v, slots)
    assert torch.equal(k.reshape(-1, 2, 8)[:9], qkv[:, 1])
    assert torch.equal(v.reshape(-1, 2, 8)[:9], qkv[:, 2])


def test_write_kv_bad_inputs_name_the_argument() -> None:
    key, value, slots, (k, v, _, _) = _case(torch.float32)
    with pytest.raises(ValueError, match="slot_mapping"):
        ops.write_kv(key, value, k, v, torch.full_like(slots, 10_000))
    with pytest.raises(TypeError, match="slot_mapping must have dtype int64"):
        ops.write_kv(key, value, k, v, slots.int())
    with pytest.raises(TypeError, match="key has dtype"):
        ops.write_kv(key.half(), value.half(), k, v, slots)
    with pytest.raises(ValueError, match="value has shape"):
        ops.write_kv(key, value[:3], k, v, slots)
    with pytest.raises(ValueError, match="heads of dim"):
        ops.write_kv(key[:, :2], value[:, :2], k, v, slots)
    with pytest.raises(ValueError, match="k_cache must be contiguous"):
        ops.write_kv(key, value, k.transpose(0, 1), v, slots)
    with pytest.raises(ValueError, match="key must be contiguous in its last dimension"):
        ops.write_kv(key.transpose(1, 2).contiguous().transpose(1, 2), value, k, v, slots)
    with pytest.raises(TypeError, match="key must be a torch.Tensor"):
        ops.write_kv(key.tolist(), value, k, v, slots)
    with pytest.raises(ValueError, match="slot_mapping has 3 entries"):
        ops.write_kv(key, value, k, v, slots[:3])


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_cuda_matches_cpu(dtype: torch.dtype) -> None:
    key, value, slots, (k, v, _, _) = _case(dtype, device="cuda")
    ops.write_kv(key, value, k, v, slots)
    key_c, value_c, slots_c, (k_c, v_c, _, _) = _case(dtype)
    ops.write_kv(key_c, value_c, k_c, v_c, slots_c)
    assert torch.equal(k.cpu(), k_c) and torch.equal(v.cpu(), v_c)


@requires_cuda
def test_write_kv_cuda_rejects_out_of_range_slots() -> None:
    key, value, slots, (k, v, _, _) = _case(torch.bfloat16, device="cuda")
    num_slots = k.shape[0] * k.shape[1]
    bad = slots.clone()
    bad[3] = num_slots  # one past the end
    message = rf"slot_mapping\[3\] = {num_slots} is outside the cache's {num_slots} slots"
    with pytest.raises(ValueError, match=message):
        ops.write_kv(key, value, k, v, bad)
    # Without the wait, the bad slot is still never written and fails the next call.
    ops.write_kv(key, value, k, v, bad, sync_check=False)
    torch.cuda.synchronize()
    with pytest.raises(ValueError, match=message):
        ops.write_kv(key, value, k, v, slots)
    k.zero_()
    v.zero_()
    ops.write_kv(key, value, k, v, slots)  # the error was reported once, then cleared
    key_c, value_c, slots_c, (k_c, v_c, _, _) = _case(torch.bfloat16)
    ops.write_kv(key_c, value_c, k_c, v_c, slots_c)
    assert torch.equal(k.cpu(), k_c) and torch.equal(v.cpu(), v_c)
