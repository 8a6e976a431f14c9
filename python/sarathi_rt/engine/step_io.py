"""What the driver sends a worker for one step and what comes back: plain, picklable
data (no tensors), so an executor may ship it to other processes unchanged.

The per-request records are slotted but not frozen: nothing changes them after they are
built, and a frozen dataclass's __init__ (object.__setattr__ per field) costs ~6x as
much, which the engine pays for every running request on every step."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Hashable

from sarathi_rt.measure.metrics import StageMetrics
from sarathi_rt.sampling import GREEDY_TEMPERATURE

from .outputs import TokenLogprob


@dataclass(slots=True)
class RowSampling:
    """How to sample one row. `num_generated` (tokens the request produced before this
    one) keys the row's random stream together with `seed`, so a request draws the same
    tokens whatever else is in its batch, and again after a preemption. `logprobs`: None,
    or how many alternatives to return with the sampled token's log probability.
    `allowed`: for a request with a grammar, the tokens it allows (bit t%32 of
    little-endian int32 word t//32, as engine.structured writes them); None allows all."""

    temperature: float
    top_k: int | None
    top_p: float
    seed: int
    num_generated: int
    logprobs: int | None = None
    allowed: bytes | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE


@dataclass(slots=True)
class SequenceChunk:
    """`token_ids` of one request at positions start_pos.. of its sequence. `block_table`
    maps every position up to start_pos + len(token_ids) to a KV block. `sampling` is
    set when this chunk ends on a token to sample from (a finished prefill, a decode).
    `prompt_targets`: the prompt tokens at positions start_pos + 1.. whose log
    probabilities (with `prompt_top` alternatives) the step returns, one per position of
    the chunk from its first. `forks`: the other samples (n > 1) of a chunk that completes
    its prompt, each drawing its first token from the same logits row after `sampling`'s.
    `num_draft`: a decode verifying proposals (speculative decoding): its last `num_draft`
    tokens are the proposals, and `sampling` draws from each of its last 1 + num_draft
    positions (RowSampling.num_generated counting up from the first; see verify_rows).
    `draft_allowed`: for such a decode with a grammar, the allowed masks of those rows
    after the first, one per proposal (row i's: the grammar after the first i
    proposals), `sampling.allowed` being the first row's; empty without a grammar."""

    request_id: Hashable
    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    sampling: RowSampling | None = None
    prompt_targets: list[int] | None = None
    prompt_top: int = 0
    forks: list[RowSampling] = field(default_factory=list)
    num_draft: int = 0
    draft_allowed: tuple[bytes, ...] = ()

    @property
    def rows(self) -> list[RowSampling]:
        """The rows this chunk samples: none, or `sampling` and its forks'."""
        return [] if self.sampling is None else [self.sampling, *self.forks]

    def verify_rows(self) -> list[RowSampling]:
        """A verifying chunk's 1 + num_draft rows, each keyed by its own token index and
        masked as of its own position."""
        if self.sampling is None or not self.num_draft:
            raise ValueError(f"chunk of {self.request_id!r} verifies no proposals (num_draft={self.num_draft})")
        if self.draft_allowed and len(self.draft_allowed) != self.num_draft:
            raise ValueError(f"draft_allowed must hold one mask per proposal ({self.num_draft}), "
                             f"got {len(self.draft_allowed)}")
        first = self.sampling
        masks = (first.allowed, *self.draft_allowed) if self.draft_allowed else (first.allowed,) * (1 + self.num_draft)
        return [replace(first, num_generated=first.num_generated + i, allowed=allowed)
                for i, allowed in enumerate(masks)]


@dataclass(slots=True)
class StepInput:
    """`block_copies`: (source, destination) KV blocks every worker copies, in its own
    layers, before the step's forward (BatchPlan.block_copies)."""

    step: int
    chunks: list[SequenceChunk] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)


@dataclass(slots=True)
class StepOutput:
    """One sampled token per row of the chunks (SequenceChunk.rows), in chunk order; `logprobs` holds the
    sampled token's log probabilities for rows that asked for them (None elsewhere).
    `tokens_per_row`: empty when every row drew one token; else, per row, how many of
    `token_ids` (and `logprobs`) it produced, in order: a verifying row's accepted
    proposals and then the target's own token.
    `prompt_logprobs`: empty when no chunk had prompt_targets, else one entry per chunk
    (None for those without). `stages`: per pipeline stage timings, when the executor
    runs stages in processes."""

    step: int
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]
    stages: list[StageMetrics] = field(default_factory=list)
    prompt_logprobs: list[list[TokenLogprob] | None] = field(default_factory=list)
    tokens_per_row: list[int] = field(default_factory=list)
