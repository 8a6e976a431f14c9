"""Text <-> token ids without transformers: a `tokenizers.Tokenizer` built from a GGUF
file's vocabulary (byte-level BPE or SentencePiece-style BPE) or read from a Hugging Face
directory's tokenizer.json, plus the model's chat template rendered the way transformers
renders it (a sandboxed jinja2 environment)."""
from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors

from sarathi_rt.models.gguf_file import GGUFFile, open_gguf

# llama.cpp's token types (tokenizer.ggml.token_type)
_UNKNOWN, _CONTROL, _USER_DEFINED, _BYTE = 2, 3, 4, 6

_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _byte_level(split: str | None = None, digits: bool = False) -> pre_tokenizers.PreTokenizer:
    """GPT-2's byte-level pre-tokenizer; `split` replaces its word regex, `digits` first
    cuts every digit apart (llama.cpp's "\\p{N}" pre-split)."""
    steps: list[pre_tokenizers.PreTokenizer] = []
    if digits:
        steps.append(pre_tokenizers.Digits(individual_digits=True))
    if split is not None:
        steps.append(pre_tokenizers.Split(Regex(split), behavior="isolated"))
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=split is None))
    return pre_tokenizers.Sequence(steps)


_BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")  # SentencePiece's byte-fallback tokens

# tokenizer.ggml.pre -> how that vocabulary's merges were learned to split text (the
# regexes llama.cpp uses for these names).
_BYTE_LEVEL_PRE = {
    **dict.fromkeys(("default", "gpt-2", "gpt2", "mpt", "olmo", "jais"), lambda: _byte_level()),
    **dict.fromkeys(("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"),
                    lambda: _byte_level(digits=True)),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "dbrx", "falcon3"),
                    lambda: _byte_level(_LLAMA3_SPLIT)),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen"), lambda: _byte_level(_QWEN2_SPLIT)),
}


class Tokenizer:
    """A model's tokenizer: encode/decode, special tokens and the chat template."""

    def __init__(self, backend: tokenizers.Tokenizer, *, bos_token_id: int | None = None,
                 eos_token_ids: Iterable[int] = (), chat_template: str | None = None, source: str = "") -> None:
        self._backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(eos_token_ids))
        self.chat_template = chat_template
        self.source = source

    # ------------------------------------------------------------------ building
    @classmethod
    def from_gguf(cls, path_or_file: str | Path | GGUFFile) -> Tokenizer:
        """The tokenizer a GGUF file describes in its `tokenizer.*` metadata."""
        gguf = path_or_file if isinstance(path_or_file, GGUFFile) else open_gguf(path_or_file)
        name, metadata = gguf.name, gguf.get
        kind = metadata("tokenizer.ggml.model")
        tokens: list[str] = metadata("tokenizer.ggml.tokens")
        types: list[int] = metadata("tokenizer.ggml.token_type", [1] * len(tokens))
        if len(types) != len(tokens):
            raise ValueError(f"{name}: tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens")
        ids = {key: metadata(f"tokenizer.ggml.{key}_token_id", None) for key in ("bos", "eos", "unknown")}
        add_bos = metadata("tokenizer.ggml.add_bos_token", kind == "llama")
        add_eos = metadata("tokenizer.ggml.add_eos_token", False)
        if kind == "gpt2":
            pre = metadata("tokenizer.ggml.pre", "default")
            if pre not in _BYTE_LEVEL_PRE:
                raise ValueError(f"{name}: unsupported tokenizer.ggml.pre {pre!r} for a byte-level BPE "
                                 f"vocabulary; supported: {sorted(_BYTE_LEVEL_PRE)}")
            merges = [tuple(m.split(" ", 1)) for m in metadata("tokenizer.ggml.merges")]
            backend = tokenizers.Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
            backend.pre_tokenizer = _BYTE_LEVEL_PRE[pre]()
            backend.decoder = decoders.ByteLevel()
        elif kind == "llama":
            scores = metadata("tokenizer.ggml.scores", None)
            merges_meta = metadata("tokenizer.ggml.merges", None)
            merges = [tuple(m.split(" ", 1)) for m in merges_meta] if merges_meta is not None else \
                _merges_from_scores(tokens, types, scores, name)
            unk = ids["unknown"]
            backend = tokenizers.Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges,
                                                      unk_token=tokens[unk] if unk is not None else None,
                                                      byte_fallback=True, fuse_unk=True))
            prefix = metadata("tokenizer.ggml.add_space_prefix", True)
            # SentencePiece writes spaces as U+2581 and (usually) prepends one to the text.
            backend.normalizer = normalizers.Sequence(
                ([normalizers.Prepend("\u2581")] if prefix else []) + [normalizers.Replace(" ", "\u2581")])
            backend.decoder = decoders.Sequence(
                [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
                + ([decoders.Strip(" ", 1, 0)] if prefix else []))
        else:
            raise ValueError(f"{name}: unsupported tokenizer.ggml.model {kind!r}; sarathi_rt builds 'gpt2' "
                             "(byte-level BPE) and 'llama' (SentencePiece BPE) vocabularies")
        # Control tokens (<|im_start|>, </s>) are matched whole and are special;
        # user-defined ones (<think>) are matched whole but are ordinary text.
        special = {_CONTROL} | ({_UNKNOWN} if kind == "llama" else set())
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                    for t, ty in zip(tokens, types) if ty in special])
        backend.add_tokens([AddedToken(t, special=False, normalized=False)
                            for t, ty in zip(tokens, types) if ty == _USER_DEFINED])
        _set_template(backend, tokens, ids["bos"] if add_bos else None, ids["eos"] if add_eos else None)
        eos = [ids["eos"]] if ids["eos"] is not None else []
        eot = metadata("tokenizer.ggml.eot_token_id", None)
        return cls(backend, bos_token_id=ids["bos"], eos_token_ids=eos + ([eot] if eot is not None else []),
                   chat_template=metadata("tokenizer.chat_template", None), source=name)

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """A Hugging Face model directory's tokenizer.json, with the special tokens and chat
        template of tokenizer_config.json (or chat_template.jinja) and the eos ids of
        generation_config.json."""
        path = Path(path)
        file = path / "tokenizer.json"
        if not file.is_file():
            raise ValueError(f"{str(path)!r} has no tokenizer.json (sarathi_rt reads fast tokenizers only)")
        backend = tokenizers.Tokenizer.from_file(str(file))
        config = _read_json(path / "tokenizer_config.json")
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text()
        bos, eos = (_token_id(backend, config.get(k)) for k in ("bos_token", "eos_token"))
        gen_eos = _read_json(path / "generation_config.json").get("eos_token_id")
        extra = gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos is not None else []
        return cls(backend, bos_token_id=bos, eos_token_ids=([eos] if eos is not None else []) + extra,
                   chat_template=template, source=str(path))

    # ------------------------------------------------------------------ using
    @property
    def vocab_size(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    @cached_property
    def max_token_chars(self) -> int:
        """No token stands for more characters of text than this (a vocabulary entry
        spells at least one character per character it covers), so a text longer than
        n times it has more than n tokens: a bound known before tokenizing."""
        return max(map(len, self._backend.get_vocab(with_added_tokens=True)))

    @cached_property
    def special_token_ids(self) -> frozenset[int]:
        return frozenset(i for i, t in self._backend.get_added_tokens_decoder().items() if t.special)

    def grammar_vocabulary(self) -> tuple[list[str], str, bool]:
        """What a grammar engine needs to know which bytes each token spells: every token's
        vocabulary string, with "" for special tokens (no text: a grammar never allows
        them), how those strings encode bytes ("byte_level": GPT-2's byte alphabet,
        "byte_fallback": SentencePiece's U+2581 spaces and <0xNN> tokens, "raw": as
        written), and whether the vocabulary prepends a space to the text (SentencePiece)."""
        vocab = self._backend.get_vocab(with_added_tokens=True)
        strings = [""] * (max(vocab.values()) + 1)
        for token, token_id in vocab.items():
            strings[token_id] = token
        for token_id in self.special_token_ids:
            strings[token_id] = ""
        backend = json.loads(self._backend.to_str())
        decoder = backend.get("decoder") or {}
        parts = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
        kinds = {part.get("type") for part in parts}
        kind = "byte_level" if "ByteLevel" in kinds else "byte_fallback" if "ByteFallback" in kinds else "raw"
        normalizer = json.dumps(backend.get("normalizer"))
        return strings, kind, '"Prepend"' in normalizer

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes token `token_id` spells, which may be part of a UTF-8 character
        (decode() shows such a token as U+FFFD); a SentencePiece token keeps its leading
        space; an added or special token is its text ("<|im_end|>")."""
        return self._token_bytes[self._check_ids([token_id])[0]]

    @cached_property
    def _token_bytes(self) -> list[bytes]:
        strings, kind, _ = self.grammar_vocabulary()
        added = {i: token.content for i, token in self._backend.get_added_tokens_decoder().items()}
        return _spelled_bytes(strings, kind, added)

    def encode(self, text: str, add_special_tokens: bool = True, parse_special: bool = True) -> list[int]:
        """`text` -> ids; add_special_tokens adds what the vocabulary asks for (a BOS).
        parse_special=False reads the text of special tokens ("<|im_end|>") as plain
        characters: for text from someone who must not write control tokens."""
        _check_text("text", text)
        backend = self._backend if parse_special else self._plain_backend
        return backend.encode(text, add_special_tokens=add_special_tokens).ids

    @cached_property
    def _plain_backend(self) -> tokenizers.Tokenizer:
        # A copy, because encode_special_tokens is the backend's state, not an argument:
        # flipping it on the shared backend would race encodes in other threads.
        backend = tokenizers.Tokenizer.from_str(self._backend.to_str())
        backend.encode_special_tokens = True
        return backend

    @cached_property
    def _special_text(self) -> re.Pattern[str]:
        texts = sorted((t.content for t in self._backend.get_added_tokens_decoder().values() if t.special),
                       key=len, reverse=True)
        return re.compile("|".join(map(re.escape, texts)) or r"(?!)")

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(self._check_ids(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str:
        return self._backend.id_to_token(self._check_ids([token_id])[0])

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        return [self._backend.id_to_token(i) for i in self._check_ids(ids)]

    def _check_ids(self, ids: Sequence[int]) -> list[int]:
        ids = list(ids)
        bad = [i for i in ids if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"ids {bad[:4]} are not token ids of this vocabulary (size {self.vocab_size})")
        return ids

    def apply_chat_template(self, conversation: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                            tokenize: bool = True, **kwargs: Any) -> list[int] | str:
        """Render `conversation` ([{"role": ..., "content": ...}, ...]) with the model's chat
        template; token ids (the template writes any BOS itself) or the text."""
        if self.chat_template is None:
            raise ValueError(f"the tokenizer of {self.source or 'this model'} has no chat template")
        if isinstance(conversation, (str, bytes)) or not isinstance(conversation, Sequence) or not conversation:
            raise ValueError("conversation must be a non-empty list of {'role': ..., 'content': ...} messages")
        for i, message in enumerate(conversation):
            if not isinstance(message, Mapping) or not isinstance(message.get("role"), str) \
                    or "content" not in message:
                raise ValueError(f"conversation[{i}] must be a dict with a str 'role' and a 'content', "
                                 f"got {message!r}")
            if isinstance(message["content"], str):
                _check_text(f"conversation[{i}]['content']", message["content"])
        text = self._render(list(conversation), add_generation_prompt, kwargs)
        if not tokenize:
            return text
        if not any(isinstance(m["content"], str) and self._special_text.search(m["content"])
                   for m in conversation):
            return self.encode(text, add_special_tokens=False)
        return self._encode_apart(conversation, text, add_generation_prompt, kwargs)

    def _render(self, messages: list[Mapping[str, Any]], add_generation_prompt: bool, kwargs: dict[str, Any]) -> str:
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     bos_token=self._token_text(self.bos_token_id),
                                     eos_token=self._token_text(self.eos_token_ids[0] if self.eos_token_ids
                                                                else None), **kwargs)

    def _encode_apart(self, conversation: Sequence[Mapping[str, Any]], text: str, add_generation_prompt: bool,
                      kwargs: dict[str, Any]) -> list[int]:
        """Ids of `text` (the rendered conversation) with special tokens read only where
        the template wrote them: message contents that spell one ("<|im_end|>") are
        tokenized as plain text, or a user could end their turn and forge a system
        turn. Found by rendering again with a unique mark in place of each content."""
        nonce = uuid.uuid4().hex
        marks: dict[str, str] = {}
        masked = []
        for i, message in enumerate(conversation):
            if isinstance(message["content"], str):
                mark = f"\x1e{nonce}:{i}\x1e"
                marks[mark] = message["content"]
                message = dict(message, content=mark)
            masked.append(message)
        rendered = self._render(masked, add_generation_prompt, kwargs)
        pieces = re.split("(" + "|".join(map(re.escape, marks)) + ")", rendered)
        if "".join(marks.get(p, p) for p in pieces) != text:
            raise ValueError("a message's content spells a special token, and this chat template changes "
                             "contents as it writes them, so they cannot be kept apart from its own special "
                             "tokens; remove the special-token text from the content")
        ids: list[int] = []
        for piece in pieces:
            if piece in marks:
                ids += self.encode(marks[piece], add_special_tokens=False, parse_special=False)
            elif piece:
                ids += self.encode(piece, add_special_tokens=False)
        return ids

    def _token_text(self, token_id: int | None) -> str:
        return "" if token_id is None else self._backend.id_to_token(token_id) or ""

    @cached_property
    def _template(self) -> Any:
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise jinja2.exceptions.TemplateError(message)

        def tojson(value: Any, indent: int | None = None) -> str:
            return json.dumps(value, ensure_ascii=False, indent=indent)

        # transformers' settings, so templates written for it render the same here.
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = tojson
        env.globals.update(raise_exception=raise_exception,
                           strftime_now=lambda fmt: datetime.now().strftime(fmt))
        try:
            return env.from_string(self.chat_template)
        except jinja2.exceptions.TemplateSyntaxError as exc:
            raise ValueError(f"the chat template of {self.source or 'this model'} does not parse: {exc}") from exc


def tokenizer_at(path: Path | None) -> Tokenizer | None:
    """The tokenizer stored with a model's weights at `path`: a GGUF file's, or a
    directory's tokenizer.json; None where there is none (a preset: no path)."""
    if path is None:
        return None
    if path.is_file():
        return Tokenizer.from_gguf(path)
    if (path / "tokenizer.json").is_file():
        return Tokenizer.from_dir(path)
    return None


def _spelled_bytes(strings: list[str], kind: str, added: dict[int, str]) -> list[bytes]:
    """The bytes each vocabulary string stands for, read as grammar_vocabulary()'s `kind`
    says; `added` tokens (id -> content) are written as plain text in any vocabulary."""
    def spell(token_id: int, s: str) -> bytes:
        if token_id in added:
            return added[token_id].encode()
        if kind == "byte_level":
            return bytes(byte_of[c] for c in s)
        if kind == "byte_fallback":
            return bytes([int(s[3:5], 16)]) if _BYTE_PIECE.fullmatch(s) else s.replace("\u2581", " ").encode()
        return s.encode()

    byte_of = {char: byte for byte, char in enumerate(_byte_alphabet())}
    return [spell(i, s) for i, s in enumerate(strings)]


def _byte_alphabet() -> list[str]:
    """GPT-2's byte-level alphabet: the printable character that stands for each byte
    0..255 (itself when printable, else the next one from U+0100 on)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(others)) for b in range(256)]


def _check_text(name: str, text: object) -> None:
    if not isinstance(text, str):
        raise TypeError(f"{name} must be a str, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:  # a lone UTF-16 surrogate, which tokenizers cannot take
        raise ValueError(f"{name} is not valid Unicode: {exc.reason} at index {exc.start}") from None


def _set_template(backend: tokenizers.Tokenizer, tokens: list[str], bos: int | None, eos: int | None) -> None:
    """Make encode(add_special_tokens=True) add the BOS/EOS the vocabulary asks for."""
    if bos is None and eos is None:
        return
    head = [tokens[bos]] if bos is not None else []
    tail = [tokens[eos]] if eos is not None else []
    pairs = [(tokens[i], i) for i in dict.fromkeys(x for x in (bos, eos) if x is not None)]
    backend.post_processor = processors.TemplateProcessing(
        single=" ".join(head + ["$A"] + tail), pair=" ".join(head + ["$A"] + tail + head + ["$B"] + tail),
        special_tokens=pairs)


def _merges_from_scores(tokens: list[str], types: list[int], scores: list[float] | None,
                        name: str) -> list[tuple[str, str]]:
    """SentencePiece files store scores, not merges: every split of a token into two
    vocabulary pieces is a merge, ranked by the merged token's score (higher first)."""
    if scores is None:
        raise ValueError(f"{name}: a 'llama' vocabulary needs tokenizer.ggml.merges or tokenizer.ggml.scores")
    vocab = {t: i for i, t in enumerate(tokens)}
    ranked = []
    for token, kind, score in zip(tokens, types, scores):
        if kind in (_CONTROL, _BYTE, _UNKNOWN):
            continue
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                ranked.append((-score, vocab[left], vocab[right], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _read_json(file: Path) -> dict[str, Any]:
    return json.loads(file.read_text()) if file.is_file() else {}


def _token_id(backend: tokenizers.Tokenizer, token: Any) -> int | None:
    """A tokenizer_config special token (a string or an AddedToken dict) -> its id."""
    if isinstance(token, dict):
        token = token.get("content")
    return backend.token_to_id(token) if isinstance(token, str) else None
