"""The CPU hybrid_attention against the float64 reference: ragged mixed batches, paging, GQA,
dtypes, chunked-prefill equivalence, layouts, and every bad input naming its argument.
(The CUDA kernel's tests, for its dtypes and head dims, are in test_attention_cuda.py.)"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sarathi_rt import ops

from attention_batches import (PagedBatch, assert_strictly_close, make_batch, move_last_split, poison_chunk_keys,
                               poison_unowned_slots, reference_and_tolerance)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """The references loop over requests in small ops, which a contended thread pool slows
    down; the kernel under test uses its own OpenMP threads either way."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
# Added to twice plain PyTorch's own error at the same dtype: room for a different but
# equally good summation order when PyTorch happens to be nearly exact.
SLACK = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 4e-3}


def assert_matches_reference(batch: PagedBatch, out: torch.Tensor, **kwargs: object) -> None:
    """Error vs float64 within twice what plain PyTorch reaches at the same dtype."""
    ref = batch.reference(**kwargs)
    torch_err = (batch.plain_torch(**kwargs).double() - ref).abs().max().item()
    err = (out.double() - ref).abs().max().item()
    assert out.dtype == batch.q.dtype and out.shape == batch.q.shape
    assert err <= 2 * torch_err + SLACK[batch.q.dtype], f"error {err:.3g} vs plain PyTorch's {torch_err:.3g}"


# Ragged lengths 1, 17, 37, 577 as decodes, whole prefills and chunks over a prefix.
MIXED = [(1, 17), (37, 37), (17, 577), (1, 577), (1, 1), (64, 600)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_mixed_batch_matches_reference(dtype: torch.dtype, block_size: int, group: int) -> None:
    batch = make_batch(MIXED, group=group, block_size=block_size, dtype=dtype)
    assert_matches_reference(batch, batch.run())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_single_kind_batches_match_reference(dtype: torch.dtype, kind: str) -> None:
    kv_lens = [1, 17, 37, 577, 64, 300]
    q_lens = [1] * len(kv_lens) if kind == "decode" else kv_lens
    batch = make_batch(list(zip(q_lens, kv_lens)), dtype=dtype)
    assert_matches_reference(batch, batch.run())


@pytest.mark.parametrize("head_dim", [8, 36, 80, 128, 256])
def test_head_dims_up_to_256(head_dim: int) -> None:
    batch = make_batch([(1, 70), (33, 33), (5, 90)], head_dim=head_dim)
    assert_matches_reference(batch, batch.run())


# Decodes read keys and values straight from the pages at the CPU's register width (4, 8
# or 16 floats per vector): every GQA group of the direct path (up to 8 rows per KV head),
# head dims of one to eight whole vectors and ones ending mid-vector or in a padding
# vector (40: 5 vectors of 8 in a row padded to 48), contexts that end mid-chunk and
# mid-page, and a long decode that the plan cuts into pieces.
SMALL_HEAD_DECODES = [(1, 1), (1, 31), (1, 33), (1, 300), (1, 517), (1, 2001)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("head_dim", [16, 32, 40, 64, 128])
@pytest.mark.parametrize("block_size", [1, 16])
def test_decodes_at_every_group_and_head_dim(dtype: torch.dtype, group: int, head_dim: int, block_size: int) -> None:
    batch = make_batch(SMALL_HEAD_DECODES, num_kv_heads=3, group=group, head_dim=head_dim, block_size=block_size,
                       dtype=dtype)
    assert_strictly_close(poison_unowned_slots(batch).run(), batch)


@pytest.mark.parametrize("group", [1, 3])
def test_one_long_decode_cut_into_pieces(group: int) -> None:
    batch = poison_unowned_slots(make_batch([(1, 5000)], num_kv_heads=3, group=group, head_dim=64,
                                            dtype=torch.bfloat16))
    plan = ops.plan_attention(batch.cu_seqlens_q, batch.seqlens_k, batch.block_tables, batch.k_cache, 3 * group)
    assert plan.num_merges > 0, "the plan should split the decode"
    assert_strictly_close(batch.run(plan=plan), batch)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_context_decode(dtype: torch.dtype) -> None:
    batch = make_batch([(1, 32768), (1, 3)], num_kv_heads=1, head_dim=128, dtype=dtype)
    assert_matches_reference(batch, batch.run())


def test_hundreds_of_requests() -> None:
    g = torch.Generator().manual_seed(1)
    kv_lens = torch.randint(1, 200, (300,), generator=g).tolist()
    q_lens = [min(kv, 24) if b % 15 == 0 else 1 for b, kv in enumerate(kv_lens)]
    q_lens[7], kv_lens[7] = 0, 5  # a request with nothing to compute this step
    batch = poison_unowned_slots(make_batch(list(zip(q_lens, kv_lens)), num_kv_heads=2, group=2, head_dim=32))
    assert_matches_reference(batch, batch.run())


# Poisoned slots past every kv_len and past every causal limit, a request with no new
# token, and a tolerance that one wrong key exceeds (see the next test).
POISONED = [(1, 577), (17, 17), (0, 9), (37, 614), (1, 1), (5, 300)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size, group, scale", [(1, 1, None), (3, 16, None), (17, 32, None), (128, 4, 10.0)])
def test_poisoned_cache_slots_are_never_read(dtype: torch.dtype, block_size: int, group: int,
                                             scale: float | None) -> None:
    batch = make_batch(POISONED, num_kv_heads=2, group=group, head_dim=32, block_size=block_size, dtype=dtype)
    batch = poison_chunk_keys(poison_unowned_slots(batch))
    assert_strictly_close(batch.run(scale=scale), batch, scale)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_strict_tolerance_catches_one_wrong_key(dtype: torch.dtype) -> None:
    """One key too many in a 577-key row moves the output by ~2e-3, under a bf16 floor:
    the error model must still see it, and the kernel must still pass it."""
    batch = make_batch([(1, 578), (1, 40)], num_kv_heads=2, group=4, head_dim=64, dtype=dtype)
    one_more, _ = reference_and_tolerance(batch)
    exact = PagedBatch(**{**batch.__dict__, "seqlens_k": torch.tensor([577, 40], dtype=torch.int32)})
    want, tol = reference_and_tolerance(exact)
    assert ((one_more - want).abs() > tol).any()
    assert_strictly_close(exact.run(), exact)


def test_context_lengths_around_64k() -> None:
    batch = make_batch([(1, 65535), (1, 65536), (1, 65537), (3, 65536)], num_kv_heads=1, group=2, head_dim=16,
                       block_size=128, dtype=torch.bfloat16)
    assert_strictly_close(poison_unowned_slots(batch).run(), batch)


def test_rows_fully_masked_in_a_split_piece() -> None:
    """A CPU plan whose last piece of a 2-query tile starts past the first query's causal
    limit: that row sees no key of the piece, and the merge must give it weight 0."""
    batch = poison_unowned_slots(make_batch([(2, 17409), (1, 40)], num_kv_heads=2, group=4, head_dim=32))
    plan = ops.plan_attention(batch.cu_seqlens_q, batch.seqlens_k, batch.block_tables, batch.k_cache, 8,
                              num_ctas=64)
    move_last_split(plan, 0, 17408)  # even splits never leave such a piece: make one
    items = plan.work_items().tolist()
    fields = dict(zip(ops.attention_plan.ITEM_FIELDS, range(len(ops.attention_plan.ITEM_FIELDS))))
    masked = [it for it in items if it[fields["partial"]] >= 0 and it[fields["request"]] == 0
              and it[fields["causal_offset"]] + 1 <= it[fields["kv_begin"]]]
    assert masked, "no piece starts past the first query's limit"
    assert_strictly_close(batch.run(plan=plan), batch)


@pytest.mark.parametrize("dtype", DTYPES)
def test_chunked_prefill_equals_one_full_causal_attention(dtype: torch.dtype) -> None:
    """A 577-token prompt as chunks of 64 through write_kv + hybrid_attention."""
    g = torch.Generator().manual_seed(2)
    n, chunk, heads, kv_heads, dim, bs = 577, 64, 8, 2, 64, 16
    q, k, v = (torch.randn(n, h, dim, generator=g).to(dtype) for h in (heads, kv_heads, kv_heads))
    num_blocks = -(-n // bs) + 4
    table = torch.randperm(num_blocks, generator=g)[:-(-n // bs)].int()
    k_cache = torch.zeros(num_blocks, bs, kv_heads, dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    positions = torch.arange(n)
    slots = (table.long()[positions // bs] * bs + positions % bs)
    chunks = []
    for start in range(0, n, chunk):
        end = min(start + chunk, n)
        ops.write_kv(k[start:end], v[start:end], k_cache, v_cache, slots[start:end])
        cu = torch.tensor([0, end - start], dtype=torch.int32)
        kv_len = torch.tensor([end], dtype=torch.int32)
        chunks.append(ops.hybrid_attention(q[start:end], k_cache, v_cache, cu, kv_len, table[None]))
    chunked = torch.cat(chunks).double()

    full_batch = PagedBatch(q, k_cache, v_cache, torch.tensor([0, n], dtype=torch.int32),
                            torch.tensor([n], dtype=torch.int32), table[None])
    assert_matches_reference(full_batch, full_batch.run())
    sdpa = F.scaled_dot_product_attention(*(t.double().transpose(0, 1) for t in (q, k, v)), is_causal=True,
                                          enable_gqa=True).transpose(0, 1)
    torch_err = (F.scaled_dot_product_attention(*(t.transpose(0, 1) for t in (q, k, v)), is_causal=True,
                                                enable_gqa=True).transpose(0, 1).double() - sdpa).abs().max().item()
    assert (chunked - sdpa).abs().max().item() <= 2 * torch_err + SLACK[dtype]
    assert (chunked - full_batch.run().double()).abs().max().item() <= 2 * torch_err + SLACK[dtype]


def test_strided_q_from_fused_qkv_and_strided_out() -> None:
    batch = make_batch(MIXED, num_kv_heads=2, group=4, head_dim=64)
    heads, kv_heads, dim = 8, 2, 64
    qkv = torch.randn(batch.q.shape[0], heads + 2 * kv_heads, dim)
    qkv[:, :heads] = batch.q
    batch.q = qkv[:, :heads]
    assert not batch.q.is_contiguous()
    out_buffer = torch.full((batch.q.shape[0], heads, 2 * dim), float("nan"))
    out = out_buffer[:, :, :dim]
    assert batch.run(out=out) is out
    assert_matches_reference(batch, out)
    assert out_buffer[:, :, dim:].isnan().all()  # nothing written outside the view


def test_out_and_scale_arguments() -> None:
    batch = make_batch(MIXED)
    out = torch.empty_like(batch.q)
    assert batch.run(out=out, scale=0.3) is out
    assert_matches_reference(batch, out, scale=0.3)


def test_results_are_deterministic() -> None:
    batch = make_batch(MIXED, group=8)
    assert torch.equal(batch.run(), batch.run())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group, head_dim", [(1, 80), (4, 64)])
def test_a_query_gets_the_same_bits_in_any_chunking(dtype: torch.dtype, group: int, head_dim: int) -> None:
    """Decode-sized steps read the pages directly, larger ones convert key chunks first;
    each query's output must not depend on which path or tile computed it."""
    n = 150
    full = make_batch([(n, n)], group=group, head_dim=head_dim, dtype=dtype)
    whole = full.run()
    for chunk in (1, 7, 64):
        parts = []
        for start in range(0, n, chunk):
            end = min(start + chunk, n)
            step = _replace(full, q=full.q[start:end], cu_seqlens_q=torch.tensor([0, end - start], dtype=torch.int32),
                            seqlens_k=torch.tensor([end], dtype=torch.int32))
            parts.append(step.run())
        assert torch.equal(torch.cat(parts), whole), f"chunks of {chunk}"


def _replace(batch: PagedBatch, **fields: object) -> PagedBatch:
    return PagedBatch(**{**batch.__dict__, **fields})


def _i32(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


# (what is wrong, exception, message fragment naming the argument, fields to replace)
BAD_INPUTS = [
    ("q not a tensor", TypeError, "q must be a torch.Tensor", lambda b: {"q": b.q.tolist()}),
    ("q float64", TypeError, "q must have dtype", lambda b: {"q": b.q.double()}),
    ("q dtype unlike cache", TypeError, "q has dtype", lambda b: {"q": b.q.half()}),
    ("q 2-d", ValueError, "q must have 3 dimensions", lambda b: {"q": b.q.flatten(1)}),
    ("q strided last dim", ValueError, "q must be contiguous in its last dimension",
     lambda b: {"q": torch.cat([b.q, b.q], 2)[:, :, ::2]}),
    ("q on another device", ValueError, "q is on meta", lambda b: {"q": b.q.to("meta")}),
    ("k_cache int", TypeError, "k_cache must have dtype", lambda b: {"k_cache": b.k_cache.int()}),
    ("k_cache 3-d", ValueError, "k_cache must have 4 dimensions", lambda b: {"k_cache": b.k_cache.flatten(2)}),
    ("k_cache not contiguous", ValueError, "k_cache must be contiguous",
     lambda b: {"k_cache": b.k_cache.transpose(0, 1).contiguous().transpose(0, 1)}),
    ("v_cache shape unlike k_cache", ValueError, "v_cache has shape", lambda b: {"v_cache": b.v_cache[:-1]}),
    ("v_cache dtype unlike k_cache", TypeError, "v_cache has dtype", lambda b: {"v_cache": b.v_cache.half()}),
    ("head counts do not divide", ValueError, "not a multiple of k_cache's 2 KV heads",
     lambda b: {"q": b.q[:, :3]}),
    ("head_dim mismatch", ValueError, "head_dim", lambda b: {"q": b.q[:, :, :32]}),
    ("cu_seqlens_q int64", TypeError, "cu_seqlens_q must have dtype int32",
     lambda b: {"cu_seqlens_q": b.cu_seqlens_q.long()}),
    ("seqlens_k int64", TypeError, "seqlens_k must have dtype int32", lambda b: {"seqlens_k": b.seqlens_k.long()}),
    ("block_tables int64", TypeError, "block_tables must have dtype int32",
     lambda b: {"block_tables": b.block_tables.long()}),
    ("block_tables 1-d", ValueError, "block_tables must have 2 dimensions",
     lambda b: {"block_tables": b.block_tables[0]}),
    ("block_tables transposed", ValueError, "block_tables must be contiguous",
     lambda b: {"block_tables": b.block_tables.t().contiguous().t()}),
    ("seqlens_k on another device", ValueError, "seqlens_k is on meta",
     lambda b: {"seqlens_k": b.seqlens_k.to("meta")}),
    ("cu_seqlens_q too short", ValueError, "cu_seqlens_q must have batch \\+ 1",
     lambda b: {"cu_seqlens_q": b.cu_seqlens_q[:-1]}),
    ("block_tables rows", ValueError, "block_tables must have 2 rows", lambda b: {"block_tables": b.block_tables[:1]}),
    ("cu_seqlens_q[0] not 0", ValueError, "cu_seqlens_q\\[0\\] must be 0", lambda b: {"cu_seqlens_q": _i32(1, 2, 3)}),
    ("cu_seqlens_q[-1] not total_q", ValueError, "cu_seqlens_q\\[-1\\] = 2", lambda b: {"cu_seqlens_q": _i32(0, 1, 2)}),
    ("cu_seqlens_q decreasing", ValueError, "cu_seqlens_q must be non-decreasing",
     lambda b: {"cu_seqlens_q": _i32(0, 4, 3)}),
    ("seqlens_k < q_len", ValueError, "seqlens_k\\[1\\] = 1 is smaller", lambda b: {"seqlens_k": _i32(9, 1)}),
    ("seqlens_k negative", ValueError, "seqlens_k\\[0\\] = -1", lambda b: {"seqlens_k": _i32(-1, 2)}),
    ("seqlens_k beyond table", ValueError, "seqlens_k\\[0\\] = 100 needs more blocks",
     lambda b: {"seqlens_k": _i32(100, 2)}),
    ("block id too large", ValueError, "block_tables\\[1\\]\\[0\\] = 99 is outside",
     lambda b: {"block_tables": torch.tensor([[0, 1, 2], [99, -1, -1]], dtype=torch.int32)}),
    ("block id negative", ValueError, "block_tables\\[0\\]\\[1\\] = -5 is outside",
     lambda b: {"block_tables": torch.tensor([[0, -5, 2], [3, -1, -1]], dtype=torch.int32)}),
]


@pytest.mark.parametrize("what, error, match, change", BAD_INPUTS, ids=[case[0] for case in BAD_INPUTS])
def test_bad_inputs_name_the_argument(what: str, error: type[Exception], match: str, change) -> None:
    batch = make_batch([(1, 9), (2, 2)], num_kv_heads=2, group=2, head_dim=64, block_size=4)
    assert batch.block_tables.shape == (2, 4)
    bad = _replace(batch, **change(batch))
    with pytest.raises(error, match=match):
        bad.run()


def test_bad_out_and_head_dim_limits() -> None:
    batch = make_batch([(1, 9), (2, 2)], head_dim=64, block_size=4)
    with pytest.raises(TypeError, match="out has dtype"):
        batch.run(out=torch.empty_like(batch.q, dtype=torch.float16))
    with pytest.raises(ValueError, match="out has shape"):
        batch.run(out=torch.empty_like(batch.q[:1]))
    with pytest.raises(ValueError, match="out must be contiguous in its last dimension"):
        batch.run(out=torch.empty(*batch.q.shape[:2], 128)[:, :, ::2])
    with pytest.raises(TypeError, match="out must be a torch.Tensor"):
        batch.run(out=batch.q.numpy())
    with pytest.raises(ValueError, match="scale must be a finite number"):
        batch.run(scale=float("nan"))
    big = make_batch([(1, 3)], head_dim=320)
    with pytest.raises(ValueError, match="Unsupported head_dim: 320"):
        big.run()
