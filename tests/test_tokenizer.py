"""The tokenizer without transformers: byte-level and SentencePiece BPE built from GGUF
metadata, a HF directory's tokenizer.json, special tokens, chat templates, bad input."""
from __future__ import annotations

import json

import pytest

from gguf_models import CHATML, SPECIAL, byte_alphabet, write_tokenizer_gguf
from sarathi_rt.text.tokenizer import Tokenizer

TEXTS = ["hello world", "hi there, héllo wörld 日本語 🙂", "  two  spaces\n\nand\ttabs 2024", "x" * 50]


@pytest.fixture(scope="module")
def byte_level(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.from_gguf(write_tokenizer_gguf(tmp_path_factory.mktemp("tok") / "bpe.gguf"))


def test_byte_level_bpe_applies_the_merges(byte_level: Tokenizer) -> None:
    ids = byte_level.encode("hello world")
    assert byte_level.convert_ids_to_tokens(ids) == ["hello", "Ġworld"]
    # digits are cut apart before the BPE (llama.cpp's "smollm" pre-tokenizer)
    alphabet = byte_alphabet()
    assert byte_level.convert_ids_to_tokens(byte_level.encode("42")) == [alphabet[ord("4")], alphabet[ord("2")]]
    assert byte_level.id_to_token(ids[0]) == "hello"


@pytest.mark.parametrize("text", TEXTS)
def test_byte_level_round_trips_any_text(byte_level: Tokenizer, text: str) -> None:
    assert byte_level.decode(byte_level.encode(text)) == text


def test_control_tokens_are_whole_and_special(byte_level: Tokenizer) -> None:
    ids = byte_level.encode("<|im_start|>hi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2 and byte_level.convert_ids_to_tokens(ids[1:-1]) == ["hi"]
    assert byte_level.special_token_ids == frozenset(range(len(SPECIAL)))
    assert byte_level.decode(ids) == "hi"
    assert byte_level.decode(ids, skip_special_tokens=False) == "<|im_start|>hi<|im_end|>"
    assert byte_level.bos_token_id == 0 and byte_level.eos_token_ids == (2,)
    assert byte_level.vocab_size == 3 + 256 + 11


def test_add_bos_flag_adds_bos(tmp_path) -> None:
    tok = Tokenizer.from_gguf(write_tokenizer_gguf(tmp_path / "bos.gguf", add_bos=True))
    assert tok.encode("hi") == [0] + tok.encode("hi", add_special_tokens=False)


def test_chat_template_renders_like_transformers(byte_level: Tokenizer) -> None:
    conv = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"}]
    text = byte_level.apply_chat_template(conv, tokenize=False)
    assert text == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert byte_level.chat_template == CHATML
    ids = byte_level.apply_chat_template(conv, add_generation_prompt=False)
    assert ids == byte_level.encode(text.removesuffix("<|im_start|>assistant\n"), add_special_tokens=False)


def test_sentencepiece_bpe_with_byte_fallback(tmp_path) -> None:
    tok = Tokenizer.from_gguf(write_tokenizer_gguf(tmp_path / "sp.gguf", kind="llama", add_bos=None))
    ids = tok.encode("hello world")
    assert ids[0] == 1  # a 'llama' vocabulary adds BOS unless the file says otherwise
    assert tok.convert_ids_to_tokens(ids[1:]) == ["\u2581hello", "\u2581world"]
    accented = tok.encode("hé", add_special_tokens=False)  # é is not a piece: its UTF-8 bytes are
    assert tok.convert_ids_to_tokens(accented) == ["\u2581h", "<0xC3>", "<0xA9>"]
    for text in ("hello world", "héllo  wörld 🙂", "world"):
        assert tok.decode(tok.encode(text)) == text
    assert tok.special_token_ids == frozenset({0, 1, 2})


def _spelled(tok: Tokenizer, text: str) -> bytes:
    return b"".join(tok.token_bytes(t) for t in tok.encode(text, add_special_tokens=False))


def test_token_bytes_are_each_tokens_own_bytes(byte_level: Tokenizer, tmp_path) -> None:
    """Joined, the tokens' bytes are the text's, even where a character spans tokens (whose
    decoded text is U+FFFD); special tokens are their text; SentencePiece keeps its spaces."""
    split = byte_level.encode("é", add_special_tokens=False)
    assert [byte_level.token_bytes(t) for t in split] == [b"\xc3", b"\xa9"]
    assert byte_level.decode(split[:1]) == "\ufffd"
    assert byte_level.token_bytes(2) == b"<|im_end|>"
    sentencepiece = Tokenizer.from_gguf(write_tokenizer_gguf(tmp_path / "sp.gguf", kind="llama", add_bos=None))
    for text in TEXTS:
        assert _spelled(byte_level, text) == text.encode()
        assert _spelled(sentencepiece, text) == b" " + text.encode()  # the vocabulary's prefix space
    assert sentencepiece.token_bytes(2) == b"</s>"
    with pytest.raises(ValueError, match="ids"):
        byte_level.token_bytes(byte_level.vocab_size)


@pytest.mark.slow
def test_token_bytes_of_smollm2() -> None:
    """SmolLM2's tokenizer (a cached GGUF) spells " 日" over three tokens."""
    from sarathi_rt.models.hub import named_model_path

    tok = Tokenizer.from_gguf(named_model_path("smollm2-135m-instruct"))
    for text in TEXTS:
        assert _spelled(tok, text) == text.encode()
    ids = tok.encode(" 日", add_special_tokens=False)
    assert [tok.token_bytes(t) for t in ids] == [b" \xe6", b"\x97", b"\xa5"]
    assert all(tok.decode([t]).endswith("\ufffd") for t in ids)


def test_from_dir_matches_transformers(tmp_path) -> None:
    transformers = pytest.importorskip("transformers")
    import tokenizers

    tokens = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(3, 40)]
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel({t: i for i, t in enumerate(tokens)}, "<unk>"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    backend.post_processor = tokenizers.processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    template = "{{ bos_token }}{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {{ eos_token }} {% endfor %}"
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>",
                                              eos_token="</s>", chat_template=template)
    hf.save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    ours = Tokenizer.from_dir(tmp_path)
    text = "w3 w4 w39 nope"
    assert ours.encode(text) == hf.encode(text) and ours.encode(text)[0] == 1
    assert ours.decode(ours.encode(text)) == hf.decode(hf.encode(text), skip_special_tokens=True)
    conv = [{"role": "w5", "content": "w6 w7"}]
    want = hf.apply_chat_template(conv, tokenize=False, add_generation_prompt=False)
    assert ours.apply_chat_template(conv, tokenize=False) == want
    assert ours.bos_token_id == 1 and ours.eos_token_ids == (2, 7)


def test_bad_input_is_named(tmp_path, byte_level: Tokenizer) -> None:
    with pytest.raises(ValueError, match="ids"):
        byte_level.decode([5, byte_level.vocab_size])
    with pytest.raises(TypeError, match="text"):
        byte_level.encode([1, 2])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"conversation\[1\]"):
        byte_level.apply_chat_template([{"role": "user", "content": "x"}, {"content": "y"}])
    with pytest.raises(ValueError, match="tokenizer.ggml.pre 'mystery'"):
        Tokenizer.from_gguf(write_tokenizer_gguf(tmp_path / "pre.gguf", pre="mystery"))
    no_template = Tokenizer.from_gguf(write_tokenizer_gguf(tmp_path / "plain.gguf", template=None))
    with pytest.raises(ValueError, match="no chat template"):
        no_template.apply_chat_template([{"role": "user", "content": "x"}])
    with pytest.raises(ValueError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


def test_unknown_tokenizer_model_is_named(tmp_path) -> None:
    import gguf

    w = gguf.GGUFWriter(str(tmp_path / "bert.gguf"), "llama")
    w.add_tokenizer_model("bert")
    w.add_token_list(["[CLS]", "a"])
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(ValueError, match=r"bert\.gguf.*tokenizer.ggml.model 'bert'"):
        Tokenizer.from_gguf(tmp_path / "bert.gguf")
