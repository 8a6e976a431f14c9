"""The real model by name: SmolLM2-135M-Instruct (Q4_1 GGUF, fetched into the cache on
first use) answers 16 chat prompts exactly as transformers' GGUF load of the same file
does, greedy token for token, under every scheduler policy and chunk sizes 7/16/64."""
from __future__ import annotations

import pytest
import torch

from hf_models import greedy
from smollm2_chats import CONVERSATIONS
from sarathi_rt import LLM, SamplingParams
from sarathi_rt.engine import worker
from sarathi_rt.models import resolve_model_path
from sarathi_rt.scheduler import available_policies, get_policy

pytestmark = pytest.mark.slow
transformers = pytest.importorskip("transformers")
MODEL = "smollm2-135m-instruct"
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def reference() -> tuple[list[list[int]], list[list[int]]]:
    """(prompt ids via the chat template, transformers' greedy continuations), once."""
    pytest.importorskip("accelerate")  # transformers needs it to read GGUF
    path = resolve_model_path(MODEL)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                           dtype=torch.float32).eval()
    with LLM(MODEL, num_kv_blocks=8) as llm:
        prompts = [llm.tokenizer.apply_chat_template(c) for c in CONVERSATIONS]
    return prompts, [greedy(hf, p, MAX_TOKENS) for p in prompts]


@pytest.fixture(scope="module")
def load_once() -> object:
    """Every engine below loads the same GGUF weights: read them once, share the model
    (each engine binds its own KV cache to it)."""
    loaded: dict[tuple, object] = {}
    real = worker.load_model

    def cached(model, dtype, device, layout, seed):
        key = (str(model), str(dtype), str(device), layout)
        if key not in loaded:
            loaded[key] = real(model, dtype, device, layout, seed)
        return loaded[key]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(worker, "load_model", cached)
        yield


def test_answers_the_capital_of_france(reference) -> None:
    prompts, expected = reference
    with LLM(MODEL, num_kv_blocks=64) as llm:
        out = llm.generate([prompts[0]], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)[0]
        assert out.token_ids == expected[0]
        assert llm.tokenizer.decode(out.token_ids) == "The capital of France is Paris."


@pytest.mark.parametrize("chunk_size", [7, 16, 64])
@pytest.mark.parametrize("policy", available_policies())
def test_greedy_equals_transformers(reference, load_once, policy: str, chunk_size: int) -> None:
    if not get_policy(policy).chunked and chunk_size != 64:
        pytest.skip("a policy that prefills whole prompts takes no chunk size: one run covers it")
    prompts, expected = reference
    chunk = chunk_size if get_policy(policy).chunked else None
    with LLM(MODEL, policy=policy, chunk_size=chunk, token_budget=128, max_num_seqs=16,
             num_kv_blocks=160, block_size=16) as llm:
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)
        assert llm.engine.scheduler.num_free_blocks == llm.engine.scheduler_config.num_blocks
    got = [o.token_ids for o in outs]
    wrong = [i for i, (g, e) in enumerate(zip(got, expected)) if g != e]
    assert not wrong, (f"{policy}/chunk {chunk_size}: prompts {wrong} differ, "
                       f"e.g. {got[wrong[0]]} vs {expected[wrong[0]]}")
