"""The draft-model proposer (speculative_method "draft"): a smaller model proposes its
greedy continuation of every decoding sample. It runs on the engine's own step path (a
Worker: the same model classes, ModelRunner and fused hybrid attention) over its own
paged KV cache and block manager, batched over the step's samples: one catch-up forward
(the tokens it has not seen, chunked under the token budget) and k - 1 decode forwards."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Hashable, Protocol, Sequence

from sarathi_rt.config import EngineConfig
from sarathi_rt.models import ResolvedModel, resolve_model
from sarathi_rt.scheduler.block_manager import BlockManager
from sarathi_rt.spec import ProposalSource
from sarathi_rt.text.detokenizer import TextDecoder
from sarathi_rt.text.tokenizer import Tokenizer, tokenizer_at

from .step_io import RowSampling, SequenceChunk, StepInput
from .worker import Worker

# The draft's token is its argmax: a point-mass proposal, which the sampler's rejection
# sampling verifies exactly at any temperature.
_GREEDY = RowSampling(0.0, None, 1.0, 0, 0)


def resolve_draft(config: EngineConfig, target: ResolvedModel, tokenizer: TextDecoder | None) -> ResolvedModel:
    """config.speculative_model looked up (as config.model is) and checked against the
    target before any weight loads: the same vocabulary, the same tokenizer where both
    have one, and no larger (layers x hidden size, see `check_draft`)."""
    assert config.speculative_model is not None  # the config tree requires it for "draft"
    try:
        draft = resolve_model(config.speculative_model, model_impl=config.model_impl,
                              trust_remote_code=config.trust_remote_code)
    except ValueError as exc:
        raise ValueError(f"speculative_model: {exc}") from None
    # A bare TextDecoder (no ids to compare) checks nothing.
    check_draft(target, draft, tokenizer if isinstance(tokenizer, Tokenizer) else None, tokenizer_at(draft.path))
    return draft


class TokenizerIds(Protocol):
    """What check_draft compares of two tokenizers (text.tokenizer.Tokenizer has them)."""

    vocab_size: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]


def check_draft(target: ResolvedModel, draft: ResolvedModel, target_tokenizer: TokenizerIds | None,
                draft_tokenizer: TokenizerIds | None) -> None:
    """ValueError naming speculative_model unless `draft` can propose for `target`.
    Size rule: layers x hidden size, the draft's at most the target's. It tracks what a
    forward costs per token (every layer runs hidden-wide matrices) and is known from the
    config of every family, before weights exist; a draft that costs as much as the
    target buys nothing, and the target itself is the largest draft allowed."""
    t, d = target.config, draft.config
    if d.vocab_size != t.vocab_size:
        raise ValueError(f"speculative_model {draft.name!r} has vocab_size {d.vocab_size}, the target "
                         f"{target.name!r} {t.vocab_size}: a draft must share the target's vocabulary")
    if target_tokenizer is not None and draft_tokenizer is not None:
        for name in ("vocab_size", "bos_token_id", "eos_token_ids"):
            ours, theirs = getattr(draft_tokenizer, name), getattr(target_tokenizer, name)
            if ours != theirs:
                raise ValueError(f"speculative_model {draft.name!r} has another tokenizer than the target "
                                 f"{target.name!r}: its {name} is {ours!r}, the target's {theirs!r}")
    draft_size, target_size = d.num_hidden_layers * d.hidden_size, t.num_hidden_layers * t.hidden_size
    if draft_size > target_size:
        raise ValueError(f"speculative_model {draft.name!r} is larger than the target {target.name!r}: "
                         f"{d.num_hidden_layers} layers x hidden {d.hidden_size} = {draft_size} against "
                         f"{t.num_hidden_layers} x {t.hidden_size} = {target_size}")


@dataclass
class _DraftSeq:
    """One sample's share of the draft cache: `tokens` are those whose KV it holds, in
    position order (the sample's tokens, then the draft's own proposals past them);
    `confirmed` of them are known to be the sample's."""

    blocks: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    confirmed: int = 0


class DraftProposer:
    """Proposes up to `k` tokens per decoding sample with the draft model `draft`.

    KV share: the draft's cache has as many blocks (of the target's block size) as the
    target's, `target_blocks`, so it can hold every token the target holds; its memory
    is the target cache's times the draft's KV bytes per token over the target's (a
    quarter for a 2-layer draft of an 8-layer target with the same heads). Where free
    memory holds fewer (Worker's auto_num_blocks rule, on what the target left), it gets
    those; a sample whose blocks do not fit gets no proposals that step.

    Rollback is lazy: each call first compares the tokens the cache holds past what was
    confirmed with the sample's tokens now, keeps the common prefix (the accepted
    proposals) and frees the blocks past it."""

    def __init__(self, config: EngineConfig, draft: ResolvedModel, k: int, target_blocks: int,
                 token_budget: int) -> None:
        draft_config = dataclasses.replace(config, model=draft.name, num_kv_blocks=None, max_model_len=None,
                                           speculative_method="none", speculative_model=None)
        self.worker = Worker(draft_config, draft, allocate=False)
        self.worker.allocate_kv_cache(min(self.worker.num_kv_blocks, target_blocks))
        self.blocks = BlockManager(self.worker.num_kv_blocks, config.block_size)
        self.k = k
        self.token_budget = token_budget
        self.max_len = self.worker.max_model_len
        self._seqs: dict[Hashable, _DraftSeq] = {}
        self._steps = 0

    @property
    def num_blocks(self) -> int:
        return self.blocks.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.blocks.num_free

    def propose_batch(self, seqs: Sequence[ProposalSource], rooms: Sequence[int]) -> list[list[int]]:
        proposals: list[list[int]] = [[] for _ in seqs]
        budget = self.token_budget
        chunks: list[SequenceChunk] = []
        live: list[tuple[int, _DraftSeq, int]] = []  # (index in seqs, its state, proposals wanted)
        for i, (seq, room) in enumerate(zip(seqs, rooms)):
            length = len(seq.prompt) + len(seq.output)
            wanted = min(self.k, room, self.max_len - length)
            if wanted <= 0 or budget == 0:
                continue
            state = self._seqs.setdefault(seq.key, _DraftSeq())
            held = self._roll_back(state, seq, length)
            # Its last k - 1 proposals' KV is written too (the k-th is never fed).
            if not self.blocks.grow(state.blocks, length + wanted - 1):
                continue
            fed = min(length - held, budget)
            budget -= fed
            tokens = [_token_at(seq, p) for p in range(held, held + fed)]
            state.tokens += tokens
            done = held + fed == length  # the chunk reaches the last token: it proposes
            chunks.append(SequenceChunk(seq.key, tokens, held, state.blocks, _GREEDY if done else None))
            if done:
                state.confirmed = length
                live.append((i, state, wanted))
        sampled = self._forward(chunks)
        for round_ in range(self.k):
            for (i, _, _), token in zip(live, sampled):
                proposals[i].append(token)
            live = [entry for entry in live if entry[2] > round_ + 1]
            if not live:
                break
            # Feed each proposal at the position after the tokens the cache holds.
            chunks = []
            for i, state, _ in live:
                token = proposals[i][-1]
                chunks.append(SequenceChunk(seqs[i].key, [token], len(state.tokens), state.blocks, _GREEDY))
                state.tokens.append(token)
            sampled = self._forward(chunks)
        return proposals

    def _roll_back(self, state: _DraftSeq, seq: ProposalSource, length: int) -> int:
        """Keep the cached tokens that are still the sample's (accepted proposals), free
        the blocks past them; the position to feed from. The last token is always fed
        again (also when the sample gained no token since the last call: the scheduler
        left it out of that step): its logits are where the proposals start."""
        held = min(state.confirmed, length - 1)
        while held < min(len(state.tokens), length - 1) and state.tokens[held] == _token_at(seq, held):
            held += 1
        del state.tokens[held:]
        self.blocks.truncate(state.blocks, held)
        return held

    def _forward(self, chunks: list[SequenceChunk]) -> list[int]:
        """One batched step of the draft; the tokens of the chunks that sample, in order."""
        if not chunks:
            return []
        self._steps += 1
        return self.worker.execute(StepInput(self._steps, chunks)).token_ids

    def release(self, key: Hashable) -> None:
        state = self._seqs.pop(key, None)
        if state is not None:
            self.blocks.release(state.blocks)


def _token_at(seq: ProposalSource, position: int) -> int:
    prompt = len(seq.prompt)
    return seq.prompt[position] if position < prompt else seq.output[position - prompt]
