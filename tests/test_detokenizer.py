"""Incremental detokenization: characters split over byte tokens, SentencePiece spaces,
special tokens, stop strings held back from streams; then text through the engine and
LLM (text prompts, chat, stop strings, stop tokens not rendered, streamed deltas)."""
from __future__ import annotations

import pytest

from gguf_models import write_tokenizer_gguf
from text_models import TINY_VOCAB, tiny_tokenizer
from sarathi_rt import LLM, SamplingParams
from sarathi_rt.text.detokenizer import Detokenizer
from sarathi_rt.text.tokenizer import Tokenizer

TEXT = "hello wörld, 日本語 🙂 hi\n\nthere"


@pytest.fixture(scope="module")
def byte_level(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.from_gguf(write_tokenizer_gguf(tmp_path_factory.mktemp("tok") / "bpe.gguf"))


@pytest.fixture(scope="module")
def sentencepiece(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    path = write_tokenizer_gguf(tmp_path_factory.mktemp("tok") / "sp.gguf", kind="llama", add_bos=None)
    return Tokenizer.from_gguf(path)


def _feed(detok: Detokenizer, ids: list[int]) -> list[str]:
    deltas = []
    for i, t in enumerate(ids):
        if detok.append(t):
            deltas.append(detok.release(True))
            return deltas
        deltas.append(detok.release(i == len(ids) - 1))
    return deltas


def test_multibyte_characters_split_over_byte_tokens(byte_level: Tokenizer) -> None:
    ids = byte_level.encode(TEXT)
    assert len(ids) > len(TEXT.encode()) // 2  # mostly single bytes: 日, 本, 語, 🙂 span 3-4 tokens each
    detok = Detokenizer(byte_level, byte_level.encode("hi"))
    deltas = _feed(detok, ids)
    assert "".join(deltas) == detok.text == TEXT
    assert not any("\ufffd" in d for d in deltas)
    assert deltas.count("") >= 2 + 2 + 2 + 3  # a 3-byte character waits for 2 tokens, 🙂 for 3


def test_sentencepiece_keeps_the_space_of_the_first_token(sentencepiece: Tokenizer) -> None:
    prompt = sentencepiece.encode("hello")
    gen = sentencepiece.encode("world hé", add_special_tokens=False)  # "▁world", "▁h", é as 2 bytes
    deltas = _feed(Detokenizer(sentencepiece, prompt), gen)
    full = sentencepiece.decode(prompt + gen)
    assert "".join(deltas) == full[len(sentencepiece.decode(prompt)):] == " world hé"
    assert deltas[-2:] == ["", "é"]  # é arrives as two byte tokens


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(byte_level: Tokenizer, skip: bool) -> None:
    ids = byte_level.encode("hi<|im_end|>hello")
    detok = Detokenizer(byte_level, [1], skip_special_tokens=skip)
    assert "".join(_feed(detok, ids)) == ("hihello" if skip else "hi<|im_end|>hello")


def test_stop_string_across_tokens_is_cut_and_never_streamed(byte_level: Tokenizer) -> None:
    ids = byte_level.encode(TEXT)
    detok = Detokenizer(byte_level, [1], stop=["\n\n", "xyz"])
    deltas = _feed(detok, ids)
    assert detok.stopped and detok.text == "".join(deltas) == TEXT[:TEXT.index("\n\n")]
    assert len(deltas) < len(ids)  # it stopped at the stop string, not at the end
    # a stop string as long as three tokens is held back until it cannot match
    held = Detokenizer(byte_level, [1], stop=["orld!"])
    seen = ""
    for t in byte_level.encode("hello world"):
        assert not held.append(t)
        seen += held.release(False)
        assert len(held.text) - len(seen) <= 4
    assert seen + held.release(True) == "hello world" and not held.stopped


def test_offsets_are_where_each_tokens_text_starts(byte_level: Tokenizer) -> None:
    """Both byte tokens of é start where é does; a special token, where the next text
    will; the tokens of a stop string, at or past the end of the cut text."""
    ids = byte_level.encode("hié<|im_end|>x!", add_special_tokens=False)
    spelled = [byte_level.token_bytes(t) for t in ids]
    assert spelled[-5:] == [b"\xc3", b"\xa9", b"<|im_end|>", b"x", b"!"]
    detok = Detokenizer(byte_level, [1], stop=["x!"])
    _feed(detok, ids)
    assert detok.text == "hié"
    assert detok.offsets[-5:] == [2, 2, 3, 3, 4]
    assert detok.offsets[:-5] == [len(byte_level.decode(ids[:i])) for i in range(len(ids) - 5)]  # "hi"


def test_rejects_appends_after_a_stop(byte_level: Tokenizer) -> None:
    detok = Detokenizer(byte_level, [1], stop="h")
    assert detok.append(byte_level.encode("hi")[0]) and detok.text == ""
    with pytest.raises(RuntimeError, match="stop string"):
        detok.append(5)


# ---------------------------------------------------------------- through the engine
@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("tiny", tokenizer=tiny_tokenizer(), num_kv_blocks=64, block_size=8, token_budget=32, max_num_seqs=8)


@pytest.mark.slow
def test_ids_beyond_the_tokenizers_vocabulary_have_no_text(tmp_path) -> None:
    small = LLM("tiny", tokenizer=write_tokenizer_gguf(tmp_path / "bpe.gguf"), num_kv_blocks=16)
    assert small.tokenizer.vocab_size < TINY_VOCAB
    out = small.generate([list(range(300, 310))], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True),
                         use_tqdm=False)[0]
    assert out.text == small.tokenizer.decode([t for t in out.token_ids if t < small.tokenizer.vocab_size])


@pytest.mark.slow
def test_text_prompts_and_text_outputs(llm: LLM) -> None:
    tok = llm.tokenizer
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    by_text, by_ids = llm.generate(["hello world", tok.encode("hello world")], greedy, use_tqdm=False)
    assert by_text.prompt_token_ids == by_ids.prompt_token_ids and by_text.token_ids == by_ids.token_ids
    assert by_text.text == tok.decode(by_text.token_ids)
    streamed = list(llm.stream(["hello world"], greedy))
    assert "".join(o.new_text for o in streamed) == streamed[-1].text == by_text.text
    assert all(o.text.endswith(o.new_text) for o in streamed)


@pytest.mark.slow
def test_stop_strings_and_stop_tokens_end_the_text(llm: LLM) -> None:
    tok = llm.tokenizer
    base = llm.generate(["hi"], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True), use_tqdm=False)[0]
    text, ids = base.text, base.token_ids
    assert len(text) > 6
    stop = text[len(text) // 2:len(text) // 2 + 2]
    cut = llm.generate(["hi"], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=["\x00", stop]),
                       use_tqdm=False)[0]
    assert cut.finish_reason == "stop" and cut.text == text[:text.index(stop)]
    assert cut.token_ids == ids[:len(cut.token_ids)] and len(cut.token_ids) < len(ids)
    k = next(i for i in range(1, len(ids)) if ids[i] not in ids[:i] and tok.decode([ids[i]]).isalpha())
    at_token = llm.generate(["hi"], SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=(ids[k],)),
                            use_tqdm=False)[0]
    assert at_token.finish_reason == "stop" and at_token.token_ids == ids[:k + 1]
    assert at_token.text == tok.decode(ids[:k])  # the stop token is not rendered
    engine = llm.engine
    assert not engine.has_unfinished() and engine.scheduler.num_free_blocks == engine.scheduler_config.num_blocks


@pytest.mark.slow
def test_chat_applies_the_template(llm: LLM) -> None:
    conv = [{"role": "user", "content": "hello"}]
    outs = llm.chat([conv, conv + [{"role": "assistant", "content": "hi"}, {"role": "user", "content": "hi"}]],
                    SamplingParams(max_tokens=3, temperature=0.0), use_tqdm=False)
    assert outs[0].prompt_token_ids == llm.tokenizer.apply_chat_template(conv)
    assert llm.chat(conv, SamplingParams(max_tokens=3, temperature=0.0), use_tqdm=False)[0].token_ids \
        == outs[0].token_ids  # one conversation on its own
    with pytest.raises(ValueError, match=r"conversations\[0\]"):
        llm.chat([[{"content": "no role"}]])


def test_stop_strings_need_a_tokenizer() -> None:
    with pytest.raises(ValueError, match="stop"):
        LLM("tiny", num_kv_blocks=16).generate([[1, 2]], SamplingParams(stop=["x"]))
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(stop=["ok", ""])
