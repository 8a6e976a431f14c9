"""The default-dtype-sensitive behaviour on both host kinds, on whichever this machine is:
the dtype rule's flags are faked in this process, so the AVX-512/BF16 kind runs bf16
(natively where the CPU has it, emulated elsewhere) and the AVX2 kind float32. The rest
of the suite runs as the AVX2 kind (conftest.cpu_without_bf16), where greedy output does
not depend on the batch around a request; here each kind is held to what its dtype
guarantees across batch compositions."""
from __future__ import annotations

import pytest
import torch

import sarathi_rt.config.tree
from sarathi_rt import LLM, SamplingParams
from sarathi_rt.engine.outputs import RequestOutput

KINDS = {"avx2": {"avx2", "fma", "f16c", "bmi2"},
         "avx512_bf16": {"avx2", "fma", "f16c", "bmi2", "avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd",
                         "avx512_bf16"}}
DEFAULT_DTYPE = {"avx2": torch.float32, "avx512_bf16": torch.bfloat16}
# Lengths that split into several 16-token chunks beside the others' decodes.
PROMPTS = [[(11 * i + 5 * j) % 250 + 3 for j in range(4 + 13 * i)] for i in range(6)]
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=2)
OPTS = dict(num_kv_blocks=96, block_size=8, token_budget=32, chunk_size=16, max_num_seqs=8)
# How far one token's log probability may move with the batch around it in bf16: a few
# bf16 roundings (2^-8 relative each) of logits of size ~1-10 through 2 layers and the
# LM head. Measured on these prompts on an AVX512-BF16 host: no move at all (torch's bf16
# GEMMs reduced each row alike at these sizes there), which another host need not repeat.
BF16_LOGPROB_SHIFT = 0.1


@pytest.fixture(params=list(KINDS))
def kind(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setattr(sarathi_rt.config.tree, "cpu_flags", lambda: set(KINDS[request.param]))
    return request.param


def _generate(llm: LLM, prompts: list[list[int]]) -> list[RequestOutput]:
    return llm.generate(prompts, GREEDY, use_tqdm=False)


def test_the_default_dtype_follows_the_host_kind(kind: str) -> None:
    with LLM("tiny", **OPTS) as llm:
        assert llm.engine.config.dtype is DEFAULT_DTYPE[kind]
        assert llm.engine.executor.worker.model.dtype is DEFAULT_DTYPE[kind]


def test_one_batch_gives_the_same_tokens_every_time(kind: str) -> None:
    with LLM("tiny", **OPTS) as llm:
        first, second = _generate(llm, PROMPTS), _generate(llm, PROMPTS)
    assert [o.token_ids for o in first] == [o.token_ids for o in second]
    assert [[lp.logprob for lp in o.logprobs] for o in first] == [[lp.logprob for lp in o.logprobs] for o in second]


def _assert_same_up_to_a_near_tie(a: RequestOutput, b: RequestOutput, shift: float) -> None:
    """a and b generate the same tokens, each with a log probability within `shift`,
    until a position where both runs' two best tokens are within 2 * shift (a near-tie the
    rounding may break either way); past it the prefixes differ and nothing is compared."""
    for i, (x, y) in enumerate(zip(a.logprobs, b.logprobs)):
        if a.token_ids[i] != b.token_ids[i]:
            for lp in (x, y):
                (_, best), (_, second) = lp.top[:2]
                assert best - second <= 2 * shift, f"token {i}: a margin of {best - second:.3f} flipped"
            return
        assert abs(x.logprob - y.logprob) <= shift, f"token {i}: {x.logprob} vs {y.logprob}"


def test_the_batch_around_a_request_moves_only_what_the_dtype_allows(kind: str) -> None:
    shift = BF16_LOGPROB_SHIFT if DEFAULT_DTYPE[kind] is torch.bfloat16 else 1e-5
    with LLM("tiny", **OPTS) as llm:
        batched = _generate(llm, PROMPTS)
        alone = [_generate(llm, [p])[0] for p in PROMPTS]
        reversed_ = _generate(llm, PROMPTS[::-1])[::-1]
    for other in (alone, reversed_):
        for a, b in zip(batched, other):
            _assert_same_up_to_a_near_tie(a, b, shift)
    if kind == "avx2":  # float32: the same tokens whatever the batch
        assert [o.token_ids for o in alone] == [o.token_ids for o in batched]
        assert [o.token_ids for o in reversed_] == [o.token_ids for o in batched]
