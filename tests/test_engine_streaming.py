"""Streaming (iterator, asyncio), the async engine, text prompts through a tokenizer, and
the `sarathi-rt generate` command."""
from __future__ import annotations

import asyncio
import shutil
import threading

import pytest

from hf_models import HFModel, build
from sarathi_rt import LLM, SamplingParams, _C
from sarathi_rt.cli import main
from sarathi_rt.config.tree import DEFAULT_MODEL
from sarathi_rt.engine import AsyncLLMEngine, async_engine

PROMPTS = [[5, 6, 7], list(range(10, 40)), [9], list(range(100, 117))]
PARAMS = [SamplingParams(temperature=0.0, max_tokens=n) for n in (5, 3, 8, 6)]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("tiny", num_kv_blocks=64, block_size=8, token_budget=32, chunk_size=8, max_num_seqs=8)


@pytest.fixture(scope="module")
def expected(llm: LLM) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


def _clean(llm: LLM) -> bool:
    engine = llm.engine
    return not engine.has_unfinished() and engine.scheduler.num_free_blocks == engine.scheduler_config.num_blocks


def test_stream_yields_each_token_once(llm: LLM, expected: list[list[int]]) -> None:
    pieces: dict[str, list[int]] = {}
    finals = {}
    for out in llm.stream(PROMPTS, PARAMS):
        assert len(out.new_token_ids) == 1 and out.request_id not in finals
        pieces.setdefault(out.request_id, []).extend(out.new_token_ids)
        assert out.token_ids == pieces[out.request_id]
        if out.finished:
            finals[out.request_id] = out
    by_prompt = {tuple(o.prompt_token_ids): o.token_ids for o in finals.values()}
    assert [by_prompt[tuple(p)] for p in PROMPTS] == expected
    assert _clean(llm)


def test_closing_a_stream_early_aborts_the_rest(llm: LLM) -> None:
    stream = llm.stream(PROMPTS, SamplingParams(temperature=0.0, max_tokens=50))
    first = [next(stream) for _ in range(3)]
    assert not any(o.finished for o in first)
    stream.close()
    assert llm.engine.num_unfinished == 0
    aborted = llm.engine.step()
    assert len(aborted) == len(PROMPTS) and all(o.finish_reason == "abort" for o in aborted)
    assert _clean(llm)


def test_astream_matches_generate(llm: LLM, expected: list[list[int]]) -> None:
    async def collect() -> dict:
        finals = {}
        async for out in llm.astream(PROMPTS, PARAMS):
            if out.finished:
                finals[tuple(out.prompt_token_ids)] = out.token_ids
        return finals

    finals = asyncio.run(collect())
    assert [finals[tuple(p)] for p in PROMPTS] == expected
    assert _clean(llm)


def test_async_engine_serves_concurrent_clients(llm: LLM, expected: list[list[int]]) -> None:
    async def client(aengine: AsyncLLMEngine, i: int) -> list[int]:
        tokens = []
        async for out in aengine.generate(PROMPTS[i], PARAMS[i], request_id=f"client-{i}"):
            tokens.extend(out.new_token_ids)
        return tokens

    async def bad(aengine: AsyncLLMEngine) -> None:
        async for _ in aengine.generate([], PARAMS[0]):
            pass

    async def leaver(aengine: AsyncLLMEngine) -> int:
        gen = aengine.generate(PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=40))
        async for out in gen:
            break
        await gen.aclose()  # leaving early aborts the request
        return len(out.token_ids)

    async def main_() -> tuple:
        aengine = AsyncLLMEngine(llm.engine)
        return await asyncio.gather(*(client(aengine, i) for i in range(len(PROMPTS))), bad(aengine),
                                    leaver(aengine), return_exceptions=True)

    *results, error, left = asyncio.run(main_())
    assert results == expected
    assert isinstance(error, ValueError) and "empty" in str(error)
    assert left == 1
    llm.engine.step()  # reports the aborted request
    assert _clean(llm)


def test_async_engine_steps_on_one_thread_of_its_own(llm: LLM, expected: list[list[int]],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Every step runs on the same thread, not the event loop's (libgomp keeps a team of
    workers per thread that runs kernels: one stepping thread keeps one team), the thread
    that built the async engine gave up its OpenMP workers, and so does the step thread
    whenever the engine goes idle; close() ends the thread."""
    stepped_on: set[int] = set()
    real_step = llm.engine.step

    def step() -> list:
        stepped_on.add(threading.get_ident())
        return real_step()

    monkeypatch.setattr(llm.engine, "step", step)

    async def main_() -> tuple[list[list[int]], AsyncLLMEngine]:
        aengine = AsyncLLMEngine(llm.engine)
        runs = []
        for i in range(len(PROMPTS)):  # one request at a time: a step loop each
            runs.append([t for out in [o async for o in aengine.generate(PROMPTS[i], PARAMS[i])]
                         for t in out.new_token_ids])
        return runs, aengine

    released = []
    monkeypatch.setattr(async_engine._C, "release_cpu_threads", lambda: released.append(threading.get_ident()))
    results, aengine = asyncio.run(main_())
    assert results == expected
    assert len(stepped_on) == 1 and threading.get_ident() not in stepped_on
    (step_thread,) = [t for t in threading.enumerate() if t.ident in stepped_on]
    aengine.close()
    step_thread.join(timeout=10)  # after the work queued on it
    assert not step_thread.is_alive()
    # The building thread first; then the step thread when the engine went idle, so a
    # caller stepping the engine itself then has the only team.
    assert released[0] == threading.get_ident() and len(released) >= 2 and set(released[1:]) == stepped_on
    assert _clean(llm)


def test_releasing_the_cpu_threads_keeps_the_kernels_working() -> None:
    """After release_cpu_threads the next parallel region starts new workers: the same results."""
    llm = LLM("tiny", num_kv_blocks=16, block_size=8)
    before = llm.generate([PROMPTS[1]], PARAMS[1], use_tqdm=False)[0].token_ids
    _C.release_cpu_threads()
    assert llm.generate([PROMPTS[1]], PARAMS[1], use_tqdm=False)[0].token_ids == before


@pytest.mark.slow
def test_text_prompts_with_a_tokenizer(tmp_path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    from transformers import PreTrainedTokenizerFast

    hf: HFModel = build("llama_gqa", tmp_path / "hf")
    path = tmp_path / "with_tokenizer"
    shutil.copytree(hf.path, path)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, 256)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(path)
    llm = LLM(str(path), num_kv_blocks=32, block_size=8)
    prompt = hf.prompts[4]
    params = SamplingParams(temperature=0.0, max_tokens=hf.max_tokens[4])
    out = llm.generate(" ".join(f"w{t}" for t in prompt), params)[0]
    assert out.prompt_token_ids == prompt and out.token_ids == hf.expected[4]
    assert out.text.split() == [f"w{t}" for t in out.token_ids if t > 2]


def test_cli_generate(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["generate", "--model", "tiny", "--prompt-ids", "5", "6", "7", "--max-tokens", "5",
                 "--num-kv-blocks", "16"])
    text = capsys.readouterr().out
    want = LLM("tiny", num_kv_blocks=16).generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=5))[0]
    assert code == 0 and f"ids: {' '.join(map(str, want.token_ids))}" in text and "finish_reason=length" in text
    assert main(["generate", "--model", "tiny", "--prompt", "hi", "--num-kv-blocks", "16"]) == 2
    assert "tokenizer" in capsys.readouterr().err
    assert main(["generate", "--model", "nonexistent-preset"]) == 2


@pytest.mark.slow  # three loads of the real model
def test_cli_generate_text_with_the_default_model(capsys: pytest.CaptureFixture[str]) -> None:
    """With no --model, a text prompt is the user's turn in SmolLM2's chat template (raw, the
    instruct model tends to end its turn at once); --raw sends the text itself."""
    question = "What is the capital of France?"
    params = SamplingParams(temperature=0.0, max_tokens=4)
    with LLM(DEFAULT_MODEL) as llm:
        chat = llm.chat([{"role": "user", "content": question}], params)[0]
        raw = llm.generate(question, params)[0]
    assert main(["generate", "--prompt", question, "--max-tokens", "4"]) == 0
    text = capsys.readouterr().out
    assert len(chat.token_ids) == 4 and f"ids: {' '.join(map(str, chat.token_ids))}" in text
    assert main(["generate", "--prompt", question, "--max-tokens", "4", "--raw"]) == 0
    assert f"ids: {' '.join(map(str, raw.token_ids))}" in capsys.readouterr().out
    assert chat.prompt_token_ids != raw.prompt_token_ids
