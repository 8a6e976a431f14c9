"""What a step costs, as the adaptive token budget asks it: the shape of a step (its
prefill tokens with their context, its decodes with theirs, the rows it samples) and
the protocol of a model that predicts the step's time from that shape."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol, Sequence


class PlannedEntry(Protocol):
    """What a step's cost reads of one entry of a step's plan (scheduler.PlanEntry)."""

    @property
    def start_pos(self) -> int: ...
    @property
    def num_tokens(self) -> int: ...
    @property
    def is_prefill(self) -> bool: ...
    @property
    def emits_token(self) -> bool: ...
    @property
    def num_draft(self) -> int: ...


class PlannedStep(Protocol):
    """What a step's cost reads of a step's plan (scheduler.BatchPlan). Named here, not
    imported: the scheduler sizes its steps with this package, so this package sits
    below it and cannot depend on it."""

    @property
    def entries(self) -> Sequence[PlannedEntry]: ...
    @property
    def num_prefill_tokens(self) -> int: ...


@dataclass(frozen=True, slots=True)
class StepShape:
    """Sums over a step's entries that its cost depends on.

    prefill_pairs: (query, key) pairs of the prefill chunks: a chunk of q tokens from
        position s attends to s + 1, ..., s + q keys.
    prefill_kv / decode_kv: KV tokens the chunks / decodes read (s + q per entry; a
        verifying decode reads its drafts' keys too).
    num_draft_tokens / draft_pairs: the draft rows of verifying decodes and their
        (query, key) pairs. A decode over s cached tokens that verifies d drafts is a
        causal chunk of 1 + d queries: its own row (counted in num_decodes) and d rows
        seeing s + 2, ..., s + 1 + d keys, each sampled. Draft rows cost what prefill
        rows cost (chunk_tokens, chunk_pairs), not what a decode's one row does.
    """

    num_prefill_tokens: int = 0
    prefill_pairs: int = 0
    prefill_kv: int = 0
    num_decodes: int = 0
    decode_kv: int = 0
    num_sampled: int = 0
    num_draft_tokens: int = 0
    draft_pairs: int = 0

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decodes + self.num_draft_tokens

    @property
    def chunk_tokens(self) -> int:
        """Query rows of causal chunks: prefill chunks and verification rows."""
        return self.num_prefill_tokens + self.num_draft_tokens

    @property
    def chunk_pairs(self) -> int:
        """(query, key) pairs of those rows."""
        return self.prefill_pairs + self.draft_pairs

    def with_drafts(self, num_draft_tokens: int, decode_context: int) -> StepShape:
        """This step with `num_draft_tokens` more draft rows, on decodes over
        `decode_context` cached tokens each (a mean: the rule that sizes speculation
        prices a count, not which decodes get it). Each row is priced as a first draft
        (s + 2 keys): a later draft sees at most k - 1 more, small beside the context."""
        d = num_draft_tokens
        return replace(self, decode_kv=self.decode_kv + d, num_sampled=self.num_sampled + d,
                       num_draft_tokens=self.num_draft_tokens + d,
                       draft_pairs=self.draft_pairs + d * (decode_context + 2))

    @classmethod
    def of_plan(cls, plan: PlannedStep) -> StepShape:
        pairs = pkv = decodes = dkv = sampled = drafts = dpairs = 0
        for e in plan.entries:
            q, s = e.num_tokens, e.start_pos
            if e.is_prefill:
                pairs += q * s + q * (q + 1) // 2
                pkv += s + q
                sampled += e.emits_token
            else:  # a decode over s cached tokens, verifying num_draft drafts after its own token
                d = e.num_draft
                decodes += q - d
                dkv += s + q
                drafts += d
                dpairs += draft_pairs(s, d)
                sampled += q
        return cls(plan.num_prefill_tokens, pairs, pkv, decodes, dkv, sampled, drafts, dpairs)

    @classmethod
    def decodes(cls, contexts: Sequence[int], drafts: Sequence[int]) -> StepShape:
        """A step of decodes only: decode i over contexts[i] cached tokens verifying
        drafts[i] draft tokens."""
        if len(contexts) != len(drafts):
            raise ValueError(f"contexts and drafts must have one entry per decode, "
                             f"got {len(contexts)} and {len(drafts)}")
        kv = pairs = 0
        for s, d in zip(contexts, drafts):
            kv += s + 1 + d
            pairs += draft_pairs(s, d)
        n, d_all = len(contexts), sum(drafts)
        return cls(0, 0, 0, n, kv, n + d_all, d_all, pairs)

    @classmethod
    def hybrid(cls, num_prefill_tokens: int, prefill_context: int, num_decodes: int,
               decode_kv: int) -> StepShape:
        """`num_decodes` decodes reading `decode_kv` KV tokens in all, plus one prefill
        chunk of `num_prefill_tokens` from position `prefill_context` that is assumed to
        sample (the conservative case: it completes its prompt)."""
        q, s = num_prefill_tokens, prefill_context
        if q <= 0:
            return cls(0, 0, 0, num_decodes, decode_kv, num_decodes)
        return cls(q, q * s + q * (q + 1) // 2, s + q, num_decodes, decode_kv, num_decodes + 1)


def draft_pairs(context: int, drafts: int) -> int:
    """(query, key) pairs of the `drafts` draft rows of a decode over `context` cached
    tokens: draft j sees the context, the decode's own token and drafts 1..j."""
    return drafts * (context + 1) + drafts * (drafts + 1) // 2


# Step sizes adaptive_prefill_tokens prices when it looks for the most tokens per second.
MAX_RATE_PROBES = 32


class StepTimeModel(Protocol):
    """Predicts one step's seconds from its shape. In the simulator it is the cost
    model itself; in the engine it learns from the steps it observes.

    margin: the share of the time limit the adaptive budget holds back for this model's
    error (SchedulerConfig.slo_margin overrides it): 0 for a model that is the step's
    time by construction (the simulator's cost model), more for one that learns."""

    margin: float

    def predict_shape(self, shape: StepShape) -> float:
        """Seconds for a step of this shape (a high quantile, not the mean, when the
        model is uncertain: the adaptive budget guards P99 TBT with it)."""

    def predict_bound(self, shape: StepShape) -> float:
        """The most seconds a step of this shape takes, or one like it with fewer
        tokens: a step sized for n prefill tokens holds fewer when a prompt ends inside
        it, and a measured profile is not monotone in the token count (the GEMM library
        picks another kernel between two sizes), so the budget checks a size against
        this bound. predict_shape for a model that is monotone in the token count."""

    def observe(self, plan: PlannedStep, seconds: float) -> None:
        """Learn from a step that ran `plan` in `seconds` (a no-op for fixed models)."""


def predict(model: StepTimeModel, num_prefill_tokens: int, decode_contexts: Sequence[int],
            prefill_context: int = 0) -> float:
    """Seconds for a step of `num_prefill_tokens` prefill tokens from `prefill_context`
    beside one decode over each of `decode_contexts` cached tokens."""
    decode_kv = sum(decode_contexts) + len(decode_contexts)
    return model.predict_shape(StepShape.hybrid(num_prefill_tokens, prefill_context, len(decode_contexts),
                                                decode_kv))


def adaptive_prefill_tokens(model: StepTimeModel, limit: float, num_decodes: int, decode_kv: int,
                            prefill_context: int, max_tokens: int, quantum: int,
                            min_tokens: int | None = None, backlog: int = 0, decode_steps: int = 0) -> int:
    """Prefill tokens n (with num_decodes + n a multiple of `quantum`, and at most
    max_tokens - num_decodes) for a step within `limit` seconds; 0 when none fits. Of
    the sizes that fit: when `backlog` prefill tokens clear within `decode_steps` steps
    at the size whose chunk alone (without the decodes) prefills fastest, that size;
    otherwise the one whose step prefills the most tokens per second (the smallest on
    a tie).
    With `min_tokens`, of the sizes that fit and hold at least that many, the one that
    adds the least time per prefill token to the decodes' step (the largest that fits
    when none holds them). A size fits when the model's bound (predict_bound: this step
    or any with fewer prefill tokens) is within the limit; binary search for the largest
    (the bound grows with n), then a scan below it (of at most MAX_RATE_PROBES sizes,
    evenly spaced) on the model's predictions."""
    lo = num_decodes // quantum + 1  # the fewest quanta that hold every decode and >= 1 prefill token
    hi = max_tokens // quantum
    first = lo
    best = 0
    while lo <= hi:
        k = (lo + hi) // 2
        n = k * quantum - num_decodes
        if model.predict_bound(StepShape.hybrid(n, prefill_context, num_decodes, decode_kv)) <= limit:
            best, lo = n, k + 1
        else:
            hi = k - 1
    if best == 0:
        return 0
    # Within the SLO, the size that prefills the most tokens per second, not the largest:
    # past it a step is slower per token (attention grows with the chunk, tile waves
    # fill unevenly), and the prefill left over rides in the next steps' slack for less.
    # At most MAX_RATE_PROBES sizes are priced (the largest always), so that an untiled
    # step (quantum 1) costs a few dozen predictions, not one per token.
    last = (best + num_decodes) // quantum
    if min_tokens is not None:
        return _cheapest(model, num_decodes, decode_kv, prefill_context, quantum,
                         max(first, -(-(min_tokens + num_decodes) // quantum)), last)
    sizes = _probe_sizes(first, last, quantum, num_decodes)
    # Who sets the number of steps decides what a prefill token costs. While the decodes
    # run `decode_steps` more steps anyway (none finishes sooner) and the backlog clears
    # within them, the decodes do: a larger chunk that spreads the decodes' time over
    # more prefill tokens saves no step and only slows every step (so every running
    # request holds its blocks longer), so the chunk that prefills fastest on its own
    # does the work at the best rate. Otherwise the prefill does: the backlog takes
    # backlog / n steps of T(n) each, so the step with the most prefill tokens per second
    # (the decodes' time an overhead spread over the chunk) clears it soonest.
    if decode_steps and backlog <= decode_steps * best:
        alone = _fastest_prefill(model, sizes, prefill_context, 0, 0)
        if backlog <= decode_steps * alone:
            return alone
    return _fastest_prefill(model, sizes, prefill_context, num_decodes, decode_kv)


def fastest_chunk_alone(model: StepTimeModel, max_tokens: int, quantum: int) -> int:
    """The prefill chunk (a multiple of `quantum`, at most `max_tokens`) that prefills the
    most tokens per second in a step of its own, from position 0: past it a chunk is
    slower per token (attention grows with the chunk, tile waves fill unevenly)."""
    sizes = _probe_sizes(1, max(1, max_tokens // quantum), quantum, 0)
    return _fastest_prefill(model, sizes, 0, 0, 0)


def _fastest_prefill(model: StepTimeModel, sizes: list[int], prefill_context: int, num_decodes: int,
                     decode_kv: int) -> int:
    """Of the prefill `sizes`, the one whose step beside `num_decodes` decodes prefills
    the most tokens per second (the smallest on a tie)."""
    rate, chosen = 0.0, sizes[-1]
    for n in sizes:
        r = n / model.predict_shape(StepShape.hybrid(n, prefill_context, num_decodes, decode_kv))
        if r > rate:
            rate, chosen = r, n
    return chosen


def _cheapest(model: StepTimeModel, num_decodes: int, decode_kv: int, prefill_context: int, quantum: int,
              first: int, last: int) -> int:
    """Of the steps of first..last quanta (the last when first > last), the prefill size
    that adds the least time per prefill token to a step of the decodes alone (the
    smallest on a tie; at most MAX_RATE_PROBES sizes priced, the last always)."""
    if first >= last:
        return last * quantum - num_decodes
    base = model.predict_shape(StepShape.hybrid(0, 0, num_decodes, decode_kv)) if num_decodes else 0.0
    cost, chosen = float("inf"), 0
    for n in _probe_sizes(first, last, quantum, num_decodes):
        c = (model.predict_shape(StepShape.hybrid(n, prefill_context, num_decodes, decode_kv)) - base) / n
        if c < cost * (1 - 1e-9):  # a tie within rounding keeps the smaller size
            cost, chosen = c, n
    return chosen


def _probe_sizes(first: int, last: int, quantum: int, num_decodes: int) -> list[int]:
    """Prefill sizes of steps of first..last quanta, at most MAX_RATE_PROBES of them,
    evenly spaced and smallest first, the last always included."""
    stride = -(-(last - first + 1) // MAX_RATE_PROBES)
    return [k * quantum - num_decodes for k in [*range(first, last, stride), last]]
