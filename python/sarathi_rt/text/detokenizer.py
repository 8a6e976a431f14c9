"""Incremental detokenization: one `Detokenizer` per request turns its generated token ids
into text as they come, and finds its stop strings.

Decoding token by token is wrong in two ways: a byte-level BPE token can hold part of a
multi-byte UTF-8 character (its text is U+FFFD until the next token completes it), and a
SentencePiece decoder drops the leading space of the first token it sees. So each new
token is decoded inside a short window of the tokens before it (starting with the tail
of the prompt), and only text that has stopped changing is released."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

# Prompt tokens that seed the window: enough for any decoder's context (a leading space,
# a character split over up to 4 byte tokens).
_CONTEXT_TOKENS = 6
_INCOMPLETE = "\ufffd"


class TextDecoder(Protocol):
    """What the detokenizer needs of a tokenizer (sarathi_rt.text.tokenizer.Tokenizer has it)."""

    special_token_ids: frozenset[int]
    vocab_size: int

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class Detokenizer:
    """The text of one request's generated tokens.

    `append(token)` renders a token and says whether a stop string now appears (the text
    is then cut where it starts: the stop string is not part of it); `offsets[i]` is where
    the text of the i-th appended token starts in `text` (a token with no text of its own
    yet, such as the first byte of a character, starts where that character will; one cut
    off by a stop string, at or past the end of the cut text). `release(finished)`
    returns the text not yet released. While stop strings are pending it keeps back the
    last len(longest stop) - 1 characters, which could still turn out to begin one, so a
    stream never shows text that is taken back."""

    def __init__(self, tokenizer: TextDecoder, prompt: Sequence[int], skip_special_tokens: bool = True,
                 stop: Sequence[str] = ()) -> None:
        self._tokenizer = tokenizer
        self._skip = tokenizer.special_token_ids if skip_special_tokens else frozenset()
        self._vocab_size = tokenizer.vocab_size
        self._stop = tuple(stop)
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        context = [t for t in prompt[-_CONTEXT_TOKENS:] if self._renders(t)]
        self._window = context       # the tokens decoded together; text before _read is settled
        self._read = len(context)
        self._settled = self._decode(context)
        self.text = ""
        self._released = 0
        self.offsets: list[int] = []
        self.stopped = False

    def _renders(self, token: int) -> bool:
        # A model's vocabulary can be padded beyond the tokenizer's: those ids have no text.
        return token not in self._skip and token < self._vocab_size

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=bool(self._skip))

    def append(self, token: int) -> bool:
        """Render one generated token; True when a stop string ends the text here."""
        if self.stopped:
            raise RuntimeError("the request already met a stop string")
        self.offsets.append(len(self.text))
        if not self._renders(token):
            return False
        self._window.append(token)
        return self._advance(final=False)

    def _advance(self, final: bool) -> bool:
        full = self._decode(self._window)
        if len(full) <= len(self._settled) or (full.endswith(_INCOMPLETE) and not final):
            return False  # nothing new yet, or a character still missing its last bytes
        before = len(self.text)
        self.text += full[len(self._settled):]
        # The newest token now starts the window: its text is the next one's context.
        self._window = self._window[self._read:]
        self._read = len(self._window)
        self._settled = self._decode(self._window)
        return self._find_stop(before)

    def _find_stop(self, before: int) -> bool:
        hits = [i for s in self._stop if (i := self.text.find(s, max(0, before - len(s) + 1))) >= 0]
        if hits:
            self.text = self.text[:min(hits)]
            self.stopped = True
        return self.stopped

    def release(self, finished: bool) -> str:
        """The text released since the last call. At the end (`finished`) bytes still
        waiting for the rest of a character are rendered as they are, and nothing is
        held back."""
        if finished and not self.stopped and self._read < len(self._window):
            self._advance(final=True)
        end = len(self.text) if finished or self.stopped else max(self._released, len(self.text) - self._hold)
        delta = self.text[self._released:end]
        self._released = end
        return delta

    @property
    def released_text(self) -> str:
        """Everything released so far (the concatenation of release()'s results)."""
        return self.text[:self._released]
