"""Log probabilities of generated and prompt tokens against a float64 log-softmax of
transformers' logits on the same weights: chunked prefills, sampled and greedy rows in
one batch, preemption (a re-prefill scores the prompt again), prefix caching on."""
from __future__ import annotations

import pytest
import torch

from hf_models import HFModel, build
from sarathi_rt import LLM, SamplingParams
from sarathi_rt.engine import RequestOutput

TOL = 1e-4


@pytest.fixture(scope="module")
def hf(tmp_path_factory: pytest.TempPathFactory) -> HFModel:
    return build("llama_gqa", tmp_path_factory.mktemp("hf"))


@torch.no_grad()
def _reference(hf: HFModel, out: RequestOutput) -> torch.Tensor:
    """float64 log-softmax of transformers' logits over prompt + output: row i scores
    the token at position i + 1."""
    ids = list(out.prompt_token_ids) + list(out.token_ids)
    logits = hf.model(torch.tensor([ids])).logits[0].double()  # type: ignore[operator]
    return logits.log_softmax(dim=1)


def _check(ref_row: torch.Tensor, token: int, got: object, k: int) -> None:
    logprob, top = got  # type: ignore[misc]
    assert logprob == pytest.approx(ref_row[token].item(), abs=TOL)
    assert len(top) == k
    best = ref_row.topk(k).values.tolist()
    assert [v for _, v in top] == pytest.approx(best, abs=TOL)
    for token_id, value in top:  # ids: each scored as the reference scores it
        assert value == pytest.approx(ref_row[token_id].item(), abs=TOL)


def _run(hf: HFModel, params: list[SamplingParams], **engine_args) -> list[RequestOutput]:
    llm = LLM(str(hf.path), **{"num_kv_blocks": 64, "block_size": 8, "chunk_size": 7, "token_budget": 16,
                               **engine_args})
    outs = llm.generate(hf.prompts, params, use_tqdm=False)
    assert llm.engine.scheduler.num_free_blocks == llm.engine.scheduler_config.num_blocks
    return outs


def _params(n: int) -> list[SamplingParams]:
    # Alternate greedy and sampled rows, so both share steps.
    return [SamplingParams(max_tokens=5, temperature=0.0 if i % 2 else 0.9, top_k=None if i % 2 else 8, seed=i,
                           logprobs=i % 4 + 1, prompt_logprobs=i % 3, ignore_eos=True) for i in range(n)]


@pytest.mark.parametrize("engine_args", [{}, {"num_kv_blocks": 9, "max_num_seqs": 8},
                                         {"enable_prefix_caching": True}],
                         ids=["chunked", "preempted", "prefix_cache"])
def test_logprobs_match_transformers(hf: HFModel, engine_args: dict) -> None:
    params = _params(len(hf.prompts))
    outs = _run(hf, params, **engine_args)
    if "num_kv_blocks" in engine_args:
        assert sum(o.metrics.num_preemptions for o in outs) > 0
    for out, p in zip(outs, params):
        ref = _reference(hf, out)
        prompt_len = len(out.prompt_token_ids)
        assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
        for j, (token, got) in enumerate(zip(out.token_ids, out.logprobs)):
            _check(ref[prompt_len + j - 1], token, got, p.logprobs or 0)
        assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == prompt_len
        assert out.prompt_logprobs[0] is None
        for i in range(1, prompt_len):
            _check(ref[i - 1], out.prompt_token_ids[i], out.prompt_logprobs[i], p.prompt_logprobs or 0)


def test_without_logprobs_none_are_returned_and_tokens_do_not_change(hf: HFModel) -> None:
    params = _params(4)
    plain = [SamplingParams(max_tokens=5, temperature=p.temperature, top_k=p.top_k, seed=p.seed, ignore_eos=True)
             for p in params]
    llm = LLM(str(hf.path), num_kv_blocks=64, block_size=8, chunk_size=7, token_budget=16)
    with_lp = llm.generate(hf.prompts[:4], params, use_tqdm=False)
    without = llm.generate(hf.prompts[:4], plain, use_tqdm=False)
    assert [o.token_ids for o in with_lp] == [o.token_ids for o in without]
    assert all(o.logprobs is None and o.prompt_logprobs is None for o in without)
