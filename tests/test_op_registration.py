"""The ops are registered with the dispatcher so torch.compile can trace through them:
schemas and fake implementations are checked by torch.library.opcheck, and a compiled
step (write_kv + attention + norm) equals eager execution."""
from __future__ import annotations

import pytest
import torch

from sarathi_rt import ops

from attention_batches import make_batch

OPCHECK_UTILS = ("test_schema", "test_faketensor")


def _step(key, value, k_cache, v_cache, slots, q, cu, seqlens_k, tables, norm_weight):
    ops.write_kv(key, value, k_cache, v_cache, slots)
    out = ops.hybrid_attention(q, k_cache, v_cache, cu, seqlens_k, tables)
    return ops.rms_norm(out.flatten(1), norm_weight, 1e-6)


def _step_inputs():
    batch = make_batch([(1, 20), (5, 5)], block_size=4, num_kv_heads=2, group=2, head_dim=16)
    g = torch.Generator().manual_seed(3)
    new = torch.randn(2, 6, 2, 16, generator=g)
    # This step's tokens: the decode's last position and the prefill's five.
    positions = [(0, 19)] + [(1, p) for p in range(5)]
    slots = torch.tensor([int(batch.block_tables[b, p // 4]) * 4 + p % 4 for b, p in positions])
    return (new[0], new[1], batch.k_cache, batch.v_cache, slots, batch.q, batch.cu_seqlens_q, batch.seqlens_k,
            batch.block_tables, torch.rand(batch.q.shape[1] * 16, generator=g))


@pytest.mark.slow
def test_compiled_step_equals_eager() -> None:
    eager_in, compiled_in = _step_inputs(), _step_inputs()
    expected = _step(*eager_in)
    got = torch.compile(_step, backend="aot_eager", fullgraph=True)(*compiled_in)
    assert torch.equal(got, expected)
    assert torch.equal(compiled_in[2], eager_in[2]), "write_kv's cache update must survive compilation"


@pytest.mark.parametrize("case", ["write_kv", "hybrid_attention_out", "rms_norm_out", "silu_and_mul_out",
                                  "rotary_embedding"])
def test_opcheck(case: str) -> None:
    key, value, k_cache, v_cache, slots, q, cu, seqlens_k, tables, weight = _step_inputs()
    x = torch.randn(6, 32)
    plan = ops.plan_attention(cu, seqlens_k, tables, k_cache, q.shape[1])
    args = {
        "write_kv": (key, value, k_cache, v_cache, slots),
        "hybrid_attention_out": (q, k_cache, v_cache, cu, seqlens_k, tables, plan.buffer, plan.capacity.as_list(),
                                 0.25, torch.empty_like(q)),
        "rms_norm_out": (x, x.clone(), torch.rand(32), 1e-6, torch.empty_like(x), torch.empty_like(x)),
        "silu_and_mul_out": (x, torch.empty(6, 16)),
        "rotary_embedding": (torch.arange(6), torch.randn(6, 4, 16), torch.randn(6, 2, 16),
                             ops.rope_cos_sin_cache(16, 32, 10000.0)),
    }[case]
    torch.library.opcheck(getattr(torch.ops.sarathi_rt, case), args, test_utils=OPCHECK_UTILS)


def test_the_layers_kernels_are_the_registered_ops() -> None:
    """The model's layers call KERNELS.<name> (no dispatcher): the same Python kernel as
    torch.ops.sarathi_rt.<name>, with the same result."""
    from sarathi_rt.ops._registry import KERNELS

    names = sorted(vars(KERNELS))
    assert names == sorted(["write_kv", "hybrid_attention_out", "hybrid_attention_planned_out", "rms_norm_out",
                            "silu_and_mul_out", "rotary_embedding", "linear_out"])
    assert all(isinstance(getattr(torch.ops.sarathi_rt, n), torch._ops.OpOverloadPacket) for n in names)
    x, weight = torch.randn(6, 32), torch.rand(32)
    outs = [torch.empty_like(x), torch.empty_like(x)]
    KERNELS.rms_norm_out(x, None, weight, 1e-6, outs[0], None)
    torch.ops.sarathi_rt.rms_norm_out(x, None, weight, 1e-6, outs[1], None)
    assert torch.equal(outs[0], outs[1])
