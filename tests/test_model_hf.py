"""Our LLaMA-family model against transformers on random-weight checkpoints: prefill
logits, and greedy generation token for token under every scheduler policy and
several chunk sizes (chunked prefills, hybrid batches, preemption)."""
from __future__ import annotations

import pytest
import torch

from conftest import requires_cuda
from hf_models import CONFIGS, HFModel, build, last_logits
from sarathi_rt import LLM, SamplingParams
from sarathi_rt.engine import RowSampling, SequenceChunk, StepInput
from sarathi_rt.scheduler import available_policies, get_policy

pytestmark = pytest.mark.slow  # long: runs in the full suite (scripts/test.sh), not the quick lane

GREEDY = SamplingParams(temperature=0.0, max_tokens=1)


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def hf(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> HFModel:
    return build(request.param, tmp_path_factory.mktemp("hf"))


def _generate(hf: HFModel, **engine_args) -> list[list[int]]:
    llm = LLM(str(hf.path), **{"num_kv_blocks": 64, "block_size": 8, **engine_args})
    params = [SamplingParams(temperature=0.0, max_tokens=m) for m in hf.max_tokens]
    outs = llm.generate(hf.prompts, params, use_tqdm=False)
    assert llm.engine.scheduler.num_free_blocks == llm.engine.scheduler_config.num_blocks
    assert not llm.engine.has_unfinished()
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("chunk_size", [7, 16, 64])
@pytest.mark.parametrize("policy", available_policies())
def test_greedy_matches_transformers(hf: HFModel, policy: str, chunk_size: int) -> None:
    if not get_policy(policy).chunked and chunk_size != 64:
        pytest.skip("a policy that prefills whole prompts takes no chunk size: one run covers it")
    chunk = chunk_size if get_policy(policy).chunked else None
    got = _generate(hf, policy=policy, chunk_size=chunk, token_budget=64, max_num_seqs=16)
    assert got == hf.expected


def test_greedy_matches_transformers_under_preemption(hf: HFModel) -> None:
    # 9 blocks of 8 tokens cannot hold every running request: decodes preempt newer
    # requests, which later re-prefill prompt + generated tokens by recompute.
    llm = LLM(str(hf.path), num_kv_blocks=9, block_size=8, token_budget=32, chunk_size=16, max_num_seqs=8)
    params = [SamplingParams(temperature=0.0, max_tokens=m) for m in hf.max_tokens]
    outs = llm.generate(hf.prompts, params, use_tqdm=False)
    assert [o.token_ids for o in outs] == hf.expected
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    assert llm.engine.scheduler.num_free_blocks == 9


def _prefill_logits(llm: LLM, prompt: list[int], chunk: int) -> torch.Tensor:
    """Last-token logits of `prompt` prefilled in chunks of `chunk` through the runner."""
    worker = llm.engine.executor.worker
    blocks = list(range(-(-len(prompt) // llm.engine.config.block_size)))
    logits = None
    for start in range(0, len(prompt), chunk):
        piece = prompt[start:start + chunk]
        last = start + len(piece) == len(prompt)
        row = RowSampling(0.0, None, 1.0, 0, 0) if last else None
        input_ids, ctx = worker.runner.prepare(StepInput(0, [SequenceChunk("r", piece, start, blocks, row)]))
        with torch.inference_mode():
            logits = worker.model.compute_logits(*worker.model(ctx, input_ids=input_ids), ctx)
    return logits[0].double()


@pytest.mark.parametrize("chunk", [5, 64])
def test_prefill_logits_match_transformers(hf: HFModel, chunk: int) -> None:
    llm = LLM(str(hf.path), num_kv_blocks=16, block_size=8)
    for prompt in hf.prompts[-4:]:
        ours = _prefill_logits(llm, prompt, chunk)
        ref = last_logits(hf.model, prompt)
        rel = (ours - ref).abs().max() / ref.abs().max()
        assert rel < 1e-4, f"{hf.name}: prompt of {len(prompt)} tokens, relative error {rel:.2e}"


def test_logprobs_are_transformers_log_softmax(hf: HFModel) -> None:
    llm = LLM(str(hf.path), num_kv_blocks=16, block_size=8)
    prompt = hf.prompts[-1]
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1, logprobs=0),
                       use_tqdm=False)[0]
    ref = torch.log_softmax(last_logits(hf.model, prompt), dim=0)[out.token_ids[0]].item()
    assert out.logprobs is not None and abs(out.logprobs[0].logprob - ref) < 1e-4


@pytest.fixture(scope="module")
def hf_cuda(tmp_path_factory: pytest.TempPathFactory) -> HFModel:
    return build("llama_hd64", tmp_path_factory.mktemp("hf_cuda"))


@requires_cuda
@pytest.mark.parametrize("dtype, tolerance", [("bfloat16", 0.05), ("float16", 0.01)])
def test_prefill_logits_on_cuda(hf_cuda: HFModel, dtype: str, tolerance: float) -> None:
    llm = LLM(str(hf_cuda.path), device="cuda", dtype=dtype, num_kv_blocks=16, block_size=16)
    for prompt in hf_cuda.prompts[-3:]:
        ours = _prefill_logits(llm, prompt, 16).cpu()
        ref = last_logits(hf_cuda.model, prompt)
        assert (ours - ref).abs().max() / ref.abs().max() < tolerance


@requires_cuda
@pytest.mark.parametrize("dtype, tolerance", [("bfloat16", 0.1), ("float16", 0.03)])
def test_generation_on_cuda_follows_transformers(hf_cuda: HFModel, dtype: str, tolerance: float) -> None:
    """Half precision may flip a near-tie, so instead of exact tokens: every token we
    generate is (within tolerance) the float32 reference's argmax given our prefix, and
    its logprob matches the reference's."""
    llm = LLM(str(hf_cuda.path), device="cuda", dtype=dtype, num_kv_blocks=64, block_size=16, token_budget=64,
              chunk_size=16, max_num_seqs=16, tile_size="auto")
    params = [SamplingParams(temperature=0.0, max_tokens=m, logprobs=0) for m in hf_cuda.max_tokens]
    outs = llm.generate(hf_cuda.prompts, params, use_tqdm=False)
    assert llm.engine.scheduler.num_free_blocks == 64
    for prompt, out in zip(hf_cuda.prompts, outs):
        with torch.no_grad():
            logits = hf_cuda.model(torch.tensor([prompt + out.token_ids])).logits[0].double()
        ref = logits[len(prompt) - 1:-1].log_softmax(dim=1)
        chosen = ref.gather(1, torch.tensor(out.token_ids).unsqueeze(1)).squeeze(1)
        assert (ref.max(dim=1).values - chosen).max() < tolerance
        assert (chosen - torch.tensor([lp.logprob for lp in out.logprobs], dtype=torch.float64)).abs().max() < tolerance


@requires_cuda
@pytest.mark.cuda
def test_layers_make_no_host_sync(hf_cuda: HFModel) -> None:
    """Once the step context is prepared, the layers only launch work: no device-to-host
    copy or synchronisation per layer."""
    llm = LLM(str(hf_cuda.path), device="cuda", dtype="bfloat16", num_kv_blocks=16, block_size=16)
    worker = llm.engine.executor.worker
    prompt = hf_cuda.prompts[-1]
    row = RowSampling(0.0, None, 1.0, 0, 0)
    input_ids, ctx = worker.runner.prepare(StepInput(0, [SequenceChunk("r", prompt, 0, list(range(16)), row)]))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.inference_mode():
            hidden, residual = worker.model(ctx, input_ids=input_ids)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert hidden.shape == (len(prompt), hf_cuda.model.config.hidden_size) and torch.isfinite(hidden).all()
