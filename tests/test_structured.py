"""Structured output (SamplingParams.json_schema, xgrammar): 50 schemas, greedy and
sampled, all parse and validate; free requests beside structured ones are unchanged;
bad schemas and a missing extra raise errors naming json_schema; preemption and abort
keep the grammar state right."""
from __future__ import annotations

import asyncio
import json
import sys
import threading

import pytest

from structured_schemas import schemas
from text_models import tiny_tokenizer
from sarathi_rt import LLM, SamplingParams
from sarathi_rt.sampling import sample_seed
from sarathi_rt.engine import AsyncLLMEngine
from sarathi_rt.engine.structured import GrammarCompiler

xgrammar = pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

PROMPTS = ["hello world", "name an animal"]
FREE = SamplingParams(max_tokens=24, temperature=0.8, seed=11, ignore_eos=True)
FREE_GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def _llm(**kw: object) -> LLM:
    args = dict(num_kv_blocks=512, block_size=8, token_budget=64, max_num_seqs=64) | kw
    return LLM("tiny", tokenizer=tiny_tokenizer(), **args)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return _llm()


def _check(out: object, schema: dict) -> None:
    assert out.finish_reason == "stop", (schema, out.text)
    jsonschema.validate(json.loads(out.text), schema)


def test_fifty_schemas_greedy_and_sampled_parse_and_validate(llm: LLM) -> None:
    """One batch of 100 structured requests beside two free ones: every structured output
    completes its value (finish_reason "stop"), parses and validates."""
    cases = schemas()
    assert len(cases) == 50 and len({json.dumps(s) for s in cases}) == 50
    params = [SamplingParams(max_tokens=160, temperature=t, seed=i, json_schema=s)
              for t in (0.0, 1.0) for i, s in enumerate(cases)]
    outs = llm.generate([PROMPTS[i % 2] for i in range(len(params))], params, use_tqdm=False)
    for out, p in zip(outs, params):
        _check(out, json.loads(p.json_schema))
    # The grammar stopped at the value's end: a request without the schema goes on.
    assert all(len(o.token_ids) < 160 for o in outs)


def test_free_requests_are_token_identical_beside_structured_ones(llm: LLM) -> None:
    alone = llm.generate(PROMPTS, [FREE, FREE_GREEDY], use_tqdm=False)
    structured = SamplingParams(max_tokens=64, temperature=1.0, seed=3, json_schema=schemas()[16])
    mixed = llm.generate(PROMPTS + PROMPTS, [FREE, FREE_GREEDY, structured, structured], use_tqdm=False)
    assert [o.token_ids for o in mixed[:2]] == [o.token_ids for o in alone]
    assert mixed[2].token_ids != alone[0].token_ids


def test_logprobs_stay_raw_under_the_grammar(llm: LLM) -> None:
    """Log probabilities are the model's, before the mask: the first token's alternatives
    are those of the same prompt without a schema."""
    free, constrained = llm.generate(PROMPTS[:1] * 2, [
        SamplingParams(max_tokens=1, temperature=0.0, logprobs=5),
        SamplingParams(max_tokens=8, temperature=0.0, logprobs=5, json_schema={"type": "boolean"})],
        use_tqdm=False)
    assert constrained.text in ("true", "false")
    top, free_top = constrained.logprobs[0].top, free.logprobs[0].top
    assert [i for i, _ in top] == [i for i, _ in free_top]
    assert [v for _, v in top] == pytest.approx([v for _, v in free_top])
    # The grammar changed the pick, not the scores: its token is below the model's argmax.
    assert constrained.token_ids[0] != free.token_ids[0]
    assert constrained.logprobs[0].logprob < free.logprobs[0].logprob


def test_each_of_n_samples_follows_the_schema_with_its_own_grammar(llm: LLM) -> None:
    """n samples fork one prefilled prompt; each has its own matcher from the start, so
    each draws what a single request with its seed draws."""
    schema = schemas()[20]
    params = SamplingParams(n=3, max_tokens=160, temperature=1.0, seed=7, json_schema=schema)
    out = llm.generate(["hello world"], params, use_tqdm=False)[0]
    assert [s.index for s in out.samples] == [0, 1, 2]
    for sample in out.samples:
        _check(sample, schema)
        single = SamplingParams(max_tokens=160, temperature=1.0, seed=sample_seed(7, sample.index), json_schema=schema)
        assert llm.generate(["hello world"], single, use_tqdm=False)[0].token_ids == sample.token_ids


def test_ignore_eos_ends_at_the_value() -> None:
    llm = _llm()
    out = llm.generate(["x"], SamplingParams(max_tokens=64, json_schema={"enum": ["yes", "no"]}, ignore_eos=True,
                                             temperature=0.0), use_tqdm=False)[0]
    assert out.finish_reason == "stop" and json.loads(out.text) in ("yes", "no")
    assert 2 not in out.token_ids  # no EOS needed: the value's end ends it


def test_preemption_keeps_the_grammar_consistent() -> None:
    """A cache too small for every request preempts and recomputes some; the outputs are
    those of a roomy engine, and still valid."""
    cases = schemas()[16:28]
    params = [SamplingParams(max_tokens=96, temperature=1.0, seed=i, json_schema=s) for i, s in enumerate(cases)]
    roomy = _llm().generate(["hello world"] * len(params), params, use_tqdm=False)
    tight = _llm(num_kv_blocks=24, max_num_seqs=12)
    outs = tight.generate(["hello world"] * len(params), params, use_tqdm=False)
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in roomy]
    for out, s in zip(outs, cases):
        _check(out, s)


def test_abort_frees_the_request_and_its_grammar() -> None:
    llm = _llm()
    engine = llm.engine
    engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=64, json_schema=schemas()[30]))
    engine.step()
    engine.abort("a")
    while engine.has_unfinished():
        engine.step()
    assert engine.scheduler.num_free_blocks == engine.scheduler_config.num_blocks
    assert not engine._seqs


def test_bad_schemas_name_json_schema_and_leave_the_engine_serving(llm: LLM) -> None:
    with pytest.raises(ValueError, match="json_schema is not valid JSON"):
        SamplingParams(json_schema="{not json")
    with pytest.raises(ValueError, match="json_schema must be a JSON schema object"):
        SamplingParams(json_schema=[{"type": "string"}])
    with pytest.raises(ValueError, match="json_schema must hold JSON values"):
        SamplingParams(json_schema={"type": "number", "maximum": float("nan")})
    with pytest.raises(ValueError, match="stop strings cannot be combined with json_schema"):
        SamplingParams(json_schema={"type": "object"}, stop=["}"])
    for bad, message in [({"type": "nonsense"}, "is not a schema xgrammar supports"),
                         ({"$ref": "#/$defs/missing"}, "is not a schema xgrammar supports"),
                         ({"type": "object", "required": ["zz"], "additionalProperties": False},
                          "has no value: it requires 'zz'")]:
        with pytest.raises(ValueError, match=f"json_schema {message}"):
            llm.engine.add_request("bad", [1, 2], SamplingParams(json_schema=bad))
        assert not llm.engine.has_request("bad")
    assert llm.generate(PROMPTS, [FREE, FREE_GREEDY], use_tqdm=False)[0].finish_reason == "length"


@pytest.mark.parametrize("string", [{"type": "string", "maxLength": 4},
                                    {"type": ["string", "null"], "minLength": 1, "maxLength": 4}])
def test_bounded_strings_refuse_raw_control_characters(string: dict) -> None:
    """A string bounded by lengths alone (of one type or of a type list) takes no raw
    tab or control byte, which JSON forbids; the list's other types stay allowed."""
    tokenizer = tiny_tokenizer()
    compiled = GrammarCompiler(tokenizer, 512, (2,)).compile(json.dumps(string))

    def accepts(text: str) -> bool:
        matcher = xgrammar.GrammarMatcher(compiled, terminate_without_stop_token=True)
        return all(matcher.accept_token(t) for t in tokenizer.encode(text, add_special_tokens=False)) \
            and matcher.is_terminated()

    assert accepts('"ab"') and not accepts('"a\tb"') and not accepts('"a\x01b"') and not accepts('"abcde"')
    assert accepts("null") == isinstance(string["type"], list)


def test_the_async_engine_compiles_off_the_event_loop(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    threads = []
    compile_grammar = llm.engine.compile_grammar
    monkeypatch.setattr(llm.engine, "compile_grammar", lambda s: threads.append(threading.get_ident())
                        or compile_grammar(s))
    # A schema this module has not compiled yet: a cached one needs no thread.
    fresh = schemas()[40] | {"description": "compiled once, off the loop"}
    params = SamplingParams(max_tokens=64, temperature=0.0, json_schema=fresh)

    async def run() -> list:
        return [out async for out in AsyncLLMEngine(llm.engine).generate([3, 4, 5], params)]

    outs = asyncio.run(run())
    assert threads and threads[0] != threading.get_ident()
    assert outs[-1].finish_reason == "stop"
    jsonschema.validate(json.loads(llm.tokenizer.decode(outs[-1].token_ids)), schemas()[40])
    with pytest.raises(ValueError, match="json_schema is not a schema"):
        asyncio.run(AsyncLLMEngine(llm.engine).add_request("x", [1], SamplingParams(json_schema={"type": "x"})))


def test_a_missing_extra_or_tokenizer_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    params = SamplingParams(json_schema={"type": "boolean"})
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # import xgrammar raises ImportError
    llm = _llm()
    with pytest.raises(ValueError, match=r"json_schema .*xgrammar.*sarathi_rt\[structured\]"):
        llm.engine.add_request("s", [1, 2], params)
    assert llm.generate(PROMPTS[:1], FREE, use_tqdm=False)[0].finish_reason == "length"
    monkeypatch.undo()
    bare = LLM("tiny", num_kv_blocks=64, block_size=8)
    with pytest.raises(ValueError, match="json_schema .*needs the engine's tokenizer"):
        bare.engine.add_request("s", [1, 2], params)


def _same_token_text(tokenizer: object, vocab_size: int) -> None:
    """xgrammar reads every token as the bytes our tokenizer decodes it to (those that
    are whole UTF-8), and none of the special tokens as text."""
    info = GrammarCompiler(tokenizer, vocab_size, tokenizer.eos_token_ids).tokenizer_info
    decoded = info.decoded_vocab
    whole = 0
    for token_id in range(tokenizer.vocab_size):
        if token_id in tokenizer.special_token_ids:
            assert token_id in info.special_token_ids or token_id in info.stop_token_ids
            continue
        try:
            text = decoded[token_id].decode()
        except UnicodeDecodeError:  # part of a character: our decode shows U+FFFD there
            continue
        whole += 1
        assert text == tokenizer.decode([token_id]), token_id
    assert whole > tokenizer.vocab_size // 2


def test_grammar_vocabulary_marks_special_tokens_and_byte_level() -> None:
    tokenizer = tiny_tokenizer()
    strings, kind, prefix_space = tokenizer.grammar_vocabulary()
    assert kind == "byte_level" and not prefix_space
    assert strings[:3] == ["", "", ""] and all(strings[3:])  # the 3 control tokens have no text
    _same_token_text(tokenizer, 512)


@pytest.mark.slow
def test_real_model_vocabulary_and_schemas() -> None:
    """SmolLM2 (byte-level BPE, 49152 tokens): the grammar reads its vocabulary as our
    tokenizer does, and its greedy answers follow the schemas."""
    llm = LLM("smollm2-135m-instruct", num_kv_blocks=256)
    _same_token_text(llm.tokenizer, llm.engine.model_config.vocab_size)
    cases = schemas()[16:24]
    conv = [{"role": "user", "content": "Describe a person in JSON."}]
    outs = llm.chat([conv] * len(cases), [SamplingParams(max_tokens=96, temperature=0.0, json_schema=s)
                                         for s in cases], use_tqdm=False)
    for out, schema in zip(outs, cases):
        _check(out, schema)
