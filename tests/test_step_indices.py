"""The core's step index builder (_C.step_indices, behind ModelRunner.prepare) against a
plain-Python reference of the same arrays, on random batches: prefill chunks from any
position (a prefix-cache hit starts past 0), decodes, prompt-logprob targets, forked
samples, decodes verifying speculative proposals, block sizes 1, 16 and 32; and every bad chunk raises naming its request."""
from __future__ import annotations

import random

import pytest
import torch

from sarathi_rt import _C
from sarathi_rt.engine.step_io import RowSampling, SequenceChunk

VOCAB, MAX_POSITION = 1000, 4096
GREEDY = RowSampling(0.0, None, 1.0, 0, 0)


def reference(chunks: list[SequenceChunk], bs: int) -> tuple[list[int], list[int], int, int]:
    """The int64 and int32 buffers of step_indices.h, the tokens and the table width."""
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    rows: list[int] = []
    cu_seqlens, seqlens_k, tables = [0], [], []
    width = max(len(c.block_table) for c in chunks)
    for c in chunks:
        start, n = c.start_pos, len(c.token_ids)
        ids += c.token_ids
        positions += range(start, start + n)
        slots += [c.block_table[p // bs] * bs + p % bs for p in range(start, start + n)]
        rows += range(cu_seqlens[-1], cu_seqlens[-1] + len(c.prompt_targets or ()))
        cu_seqlens.append(cu_seqlens[-1] + n)
        rows += range(cu_seqlens[-1] - 1 - c.num_draft, cu_seqlens[-1] - 1)
        rows += [cu_seqlens[-1] - 1] * len(c.rows)
        seqlens_k.append(start + n)
        tables += c.block_table + [0] * (width - len(c.block_table))
    return ids + positions + slots + rows, cu_seqlens + seqlens_k + tables, len(ids), width


def random_batch(rng: random.Random, bs: int) -> list[SequenceChunk]:
    chunks = []
    for i in range(rng.randint(1, 12)):
        kind = rng.choice(("decode", "prefill", "cached prefill", "verify"))
        if kind == "decode":
            start, n = rng.randint(1, 300), 1
        elif kind == "verify":  # a decode with speculative proposals after its token
            start, n = rng.randint(1, 300), rng.randint(2, 9)
        elif kind == "prefill":
            start, n = 0, rng.randint(1, 200)
        else:  # a prefix-cache hit: whole blocks skipped, then the rest of the prompt
            start, n = bs * rng.randint(1, 8), rng.randint(1, 100)
        spare = rng.randint(0, 2)  # tables may reach past the chunk (blocks taken for later)
        table = rng.sample(range(5000), -(-(start + n) // bs) + spare)
        sampling = GREEDY if kind in ("decode", "verify") or rng.random() < 0.5 else None
        targets = [rng.randrange(VOCAB) for _ in range(rng.randint(1, n))] if kind in ("prefill", "cached prefill") \
            and rng.random() < 0.3 else None
        forks = [GREEDY] * rng.randint(1, 3) if sampling is not None and kind == "prefill" and rng.random() < 0.3 \
            else []
        chunks.append(SequenceChunk(f"r{i}", [rng.randrange(VOCAB) for _ in range(n)], start, table, sampling,
                                    targets, forks=forks, num_draft=n - 1 if kind == "verify" else 0))
    return chunks


def built(chunks: list[SequenceChunk], bs: int) -> tuple[list[int], list[int], int, int]:
    longs, ints, tokens, width = _C.step_indices(chunks, bs, MAX_POSITION, VOCAB)
    return (torch.frombuffer(longs, dtype=torch.int64).tolist(), torch.frombuffer(ints, dtype=torch.int32).tolist(),
            tokens, width)


@pytest.mark.parametrize("bs", [1, 16, 32])
def test_random_batches_match_the_reference(bs: int) -> None:
    rng = random.Random(bs)
    for _ in range(200):
        chunks = random_batch(rng, bs)
        assert built(chunks, bs) == reference(chunks, bs)


def test_all_decodes_and_a_lone_prefill() -> None:
    decodes = [SequenceChunk(i, [i + 1], 40 + i, [7 * i + k for k in range(7)], GREEDY) for i in range(64)]
    assert built(decodes, 16) == reference(decodes, 16)
    prefill = [SequenceChunk("p", list(range(1, 33)), 0, [3, 9], None)]  # a chunk that samples nothing
    longs, ints, tokens, width = built(prefill, 16)
    assert (tokens, width) == (32, 2) and len(longs) == 3 * 32  # no logits rows
    assert longs[64:] == [3 * 16 + p for p in range(16)] + [9 * 16 + p for p in range(16)]


@pytest.mark.parametrize("chunk, message", [
    (SequenceChunk("a", [], 0, [0]), r"request 'a': empty chunk or negative start_pos"),
    (SequenceChunk("b", [1], -1, [0]), r"request 'b': empty chunk or negative start_pos"),
    (SequenceChunk("c", [1], MAX_POSITION, [0] * 300), r"request 'c' ?: reaches position 4096, beyond the model's "
                                                       r"max_position_embeddings \(4096\)"),
    (SequenceChunk("d", [1, 2], 15, [0]), r"request 'd': block_table of 1 blocks does not map positions 0..16"),
    (SequenceChunk("e", [1], 0, [0], None, [4, 5]), r"request 'e': 2 prompt_targets for a chunk of 1 tokens"),
    (SequenceChunk("f", ["x"], 0, [0]), r"request 'f': token_ids must be a list of ints"),
    (SequenceChunk("g", [1], 0, [2 ** 40]), r"request 'g': block_table must be a list of int32 block ids"),
    (SequenceChunk("h", [VOCAB], 0, [0]), r"token ids must be in \[0, 1000\)"),
    (SequenceChunk("i", [-1], 0, [0]), r"token ids must be in \[0, 1000\)"),
    (SequenceChunk("j", [1, 2], 0, [0], GREEDY, num_draft=2), r"request 'j': 2 draft tokens in a chunk of 2 tokens"),
    (SequenceChunk("k", [1, 2], 0, [0], None, num_draft=1), r"request 'k': 1 draft tokens .* with 0 samples"),
    (SequenceChunk("l", [1, 2], 0, [0], GREEDY, [5], num_draft=1), r"request 'l': 1 draft tokens .* 1 prompt_targets"),
    (SequenceChunk("m", [1, 2], 0, [0], GREEDY, num_draft=-1), r"request 'm': -1 draft tokens"),
])
def test_a_bad_chunk_names_its_request(chunk: SequenceChunk, message: str) -> None:
    good = SequenceChunk("ok", [1], 3, [0], GREEDY)
    with pytest.raises(ValueError, match=message):
        _C.step_indices([good, chunk], 16, MAX_POSITION, VOCAB)


def test_no_chunks_is_an_error() -> None:
    with pytest.raises(ValueError, match="step has no chunks"):
        _C.step_indices([], 16, MAX_POSITION, VOCAB)
