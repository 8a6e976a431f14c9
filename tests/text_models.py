"""A byte-level BPE tokenizer that covers the whole vocabulary of the `tiny` preset (512
ids: 3 control tokens, the 256 byte symbols, 253 two-letter merges), so every token a
random-weight tiny model generates has text."""
from __future__ import annotations

import itertools
import string

import tokenizers
from tokenizers import AddedToken, decoders, models, pre_tokenizers

from gguf_models import CHATML, SPECIAL, byte_alphabet
from sarathi_rt.text.tokenizer import Tokenizer

TINY_VOCAB = 512


def tiny_tokenizer() -> Tokenizer:
    pairs = list(itertools.product(string.ascii_lowercase, repeat=2))[:TINY_VOCAB - len(SPECIAL) - 256]
    tokens = SPECIAL + byte_alphabet() + [a + b for a, b in pairs]
    backend = tokenizers.Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, pairs))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    return Tokenizer(backend, bos_token_id=0, eos_token_ids=[2], chat_template=CHATML, source="tiny")
