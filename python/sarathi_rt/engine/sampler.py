"""Logits -> next tokens. Every row is processed on its own values only, and random rows
draw from a generator keyed by (seed, tokens generated so far): a request's tokens do
not depend on what else is in the batch."""
from __future__ import annotations

import numpy as np
import torch

from sarathi_rt.ops.elementwise import argmax_rows
from sarathi_rt.utils.nvtx import nvtx_range

from .outputs import TokenLogprob
from .step_io import RowSampling

_MASK64 = (1 << 64) - 1


def row_seed(seed: int, num_generated: int) -> int:
    """A well-mixed 63-bit seed for one (request seed, token index) pair (splitmix64)."""
    x = (seed * 0x9E3779B97F4A7C15 + num_generated + 1) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) >> 1


def _filter(logits: torch.Tensor, rows: list[RowSampling]) -> torch.Tensor:
    """Temperature, then top-k, then top-p; masked entries become -inf."""
    temps = torch.tensor([r.temperature for r in rows], device=logits.device).unsqueeze(1)
    logits = logits / temps
    vocab = logits.shape[1]
    top_k = [r.top_k if r.top_k is not None and r.top_k < vocab else vocab for r in rows]
    top_p = [r.top_p for r in rows]
    if all(k == vocab for k in top_k) and all(p >= 1.0 for p in top_p):
        return logits
    # Stable sort keeps ties in vocabulary order, so the kept set is deterministic.
    ordered, order = logits.sort(dim=1, descending=True, stable=True)
    rank = torch.arange(vocab, device=logits.device).unsqueeze(0)
    drop = rank >= torch.tensor(top_k, device=logits.device).unsqueeze(1)
    ordered = ordered.masked_fill(drop, float("-inf"))
    probs = ordered.softmax(dim=1)
    # Keep a token when the mass strictly before it is below p (the first always stays).
    before = probs.cumsum(dim=1) - probs
    drop = before >= torch.tensor(top_p, device=logits.device).unsqueeze(1)
    ordered = ordered.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter_(1, order, ordered)


def _apply_grammars(logits: torch.Tensor, rows: list[RowSampling]) -> torch.Tensor:
    """`logits` with the tokens each row's grammar forbids at -inf (a copy, so the raw
    logits stay for the log probabilities); the rows without a grammar are untouched."""
    masked = [i for i, r in enumerate(rows) if r.allowed is not None]
    if not masked:
        return logits
    # Bit t%32 of little-endian word t//32 is bit t%8 of byte t//8: numpy's little-endian
    # unpackbits puts token t's bit at index t in one pass over the bytes, with no int32
    # tensor of 32 shifted copies of every word.
    packed = np.frombuffer(b"".join(rows[i].allowed or b"" for i in masked), dtype=np.uint8)
    bits = torch.from_numpy(np.unpackbits(packed, bitorder="little").view(np.bool_))
    allowed = bits.view(len(masked), -1)[:, :logits.shape[1]].to(logits.device)
    if len(masked) == len(rows):  # every row has a grammar (one request verifying drafts, say)
        return logits.masked_fill(~allowed, float("-inf"))
    index = torch.tensor(masked, device=logits.device)
    return logits.index_copy(0, index, logits.index_select(0, index).masked_fill_(~allowed, float("-inf")))


def token_logprobs(logits: torch.Tensor, targets: list[int], top: list[int]) -> list[TokenLogprob]:
    """Row i's log probability of token targets[i] and its top[i] most likely tokens, from
    the raw logits (before temperature, filtering or a grammar mask)."""
    logp = logits.float().log_softmax(dim=1)
    index = torch.tensor(targets, device=logits.device).unsqueeze(1)
    chosen = logp.gather(1, index).squeeze(1).tolist()
    k = max(top)
    if k == 0:
        return [TokenLogprob(v, ()) for v in chosen]
    values, ids = logp.topk(k, dim=1)
    values, ids = values.tolist(), ids.tolist()
    return [TokenLogprob(v, tuple(zip(ids[i][:top[i]], values[i][:top[i]]))) for i, v in enumerate(chosen)]


class Sampler:
    """Greedy rows take the argmax (the first on ties, as transformers does); the others
    sample by the exponential race, argmax(p / E) with E ~ Exp(1) from the row's own
    generator, which picks token i with probability p_i. A row with a grammar
    (RowSampling.allowed) first loses the tokens its grammar forbids.

    `drafts` (speculative decoding): per row, a proposed token to judge (None: none).
    A greedy row's token is still its argmax (the proposal stands when they agree); a
    random row keeps the proposal x with probability p(x), else draws from p with x
    removed, renormalised (U then the race, from the row's generator): its token is
    distributed as p either way, which is what makes speculation exact in distribution."""

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, rows: list[RowSampling], drafts: list[int | None] | None = None
                 ) -> tuple[list[int], list[TokenLogprob | None]]:
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits must be [len(rows)={len(rows)}, vocab], got {tuple(logits.shape)}")
        if drafts is not None and len(drafts) != len(rows):
            raise ValueError(f"drafts must hold one entry per row ({len(rows)}), got {len(drafts)}")
        with nvtx_range("sample"):
            raw = logits.float()
            logits = _apply_grammars(raw, rows)
            tokens = argmax_rows(logits)
            random_rows = [i for i, r in enumerate(rows) if not r.greedy]
            if random_rows:
                index = torch.tensor(random_rows, device=logits.device)
                probs = _filter(logits.index_select(0, index), [rows[i] for i in random_rows]).softmax(dim=1)
                noise = torch.empty_like(probs)
                judged = [] if drafts is None else [(j, d) for j, i in enumerate(random_rows)
                                                    if (d := drafts[i]) is not None]
                uniform = torch.empty(len(random_rows), dtype=probs.dtype, device=probs.device)
                for j, i in enumerate(random_rows):
                    gen = torch.Generator(logits.device).manual_seed(row_seed(rows[i].seed, rows[i].num_generated))
                    if drafts is not None and drafts[i] is not None:  # only judged rows draw U first
                        uniform[j:j + 1].uniform_(generator=gen)
                    noise[j].exponential_(generator=gen)
                # exponential_ may return exactly 0; 0/0 would be NaN, which argmax prefers.
                noise.clamp_(min=torch.finfo(noise.dtype).tiny)
                if judged:
                    at = torch.tensor([j for j, _ in judged], device=probs.device)
                    proposed = torch.tensor([d for _, d in judged], device=probs.device)
                    keep = uniform[at] < probs[at, proposed]
                    probs[at, proposed] = 0.0  # rejected: the race runs over p without the proposal
                race = (probs / noise).argmax(dim=1)
                if judged:
                    race[at] = torch.where(keep, proposed, race[at])
                tokens.index_copy_(0, index, race)
            token_ids = tokens.tolist()
            logprobs: list[TokenLogprob | None] = [None] * len(rows)
            want = [i for i, r in enumerate(rows) if r.logprobs is not None]
            if want:
                index = torch.tensor(want, device=logits.device)
                values = token_logprobs(raw.index_select(0, index), [token_ids[i] for i in want],
                                        [rows[i].logprobs or 0 for i in want])
                for i, v in zip(want, values):
                    logprobs[i] = v
            return token_ids, logprobs
