"""The scheduler's speculative-decoding bookkeeping (docs/speculative.md): which decodes
may be asked for proposals, the proposals set for the next plan, the draft rows a plan's
decodes verify (the rule itself is speculation.py's), and the checks and block rollback
after a verifying step. A mixin of `Scheduler`, whose state it reads."""
from __future__ import annotations

import itertools
import math
from collections import deque
from typing import Callable, Hashable, Mapping, Sequence

from .batch_plan import PlanEntry, StepBuilder
from .block_manager import BlockManager
from .config import SchedulerConfig
from .request import Request, generated_tokens
from .speculation import SpecCandidate, draft_floor, speculation_lengths
from sarathi_rt.step_time import StepShape, StepTimeModel
from sarathi_rt.utils.checks import non_negative_int


class Drafting:
    """Scheduler's speculation methods; `Scheduler.__init__` sets the state below."""

    config: SchedulerConfig
    step_time_model: StepTimeModel | None
    _blocks: BlockManager
    _live: dict[Hashable, Request]
    _proposed: list[Request]
    _waiting: deque[Request]
    _running: dict[Hashable, Request]

    def speculation_candidates(self) -> list[Hashable]:
        """The decodes the next plan could allot drafts to (speculative decoding): those
        it will carry (running past their prompt, not in a plan in flight) with room for
        a draft under max_new_tokens and an acceptance estimate at or above the rule's
        floor (`draft_floor`: the price of one draft in a step of those decodes). Empty
        when not even the best could get one, as with many decodes: ask the proposer for
        these only, and the step pays nothing per decode for speculating."""
        decodes = [r for r in self._running.values() if not r.in_flight and r.num_computed >= r.prefill_target]
        if not decodes:
            return []
        budget_left = self.config.token_budget - len(decodes)
        floor = draft_floor(len(decodes), budget_left, step_time=self._decodes_step_time(decodes),
                            time_target=self.config.tbt_slo, prefill_waiting=self._prefill_waiting(budget_left))
        if floor > 1.0:
            return []
        return [r.request_id for r in decodes
                if r.num_generated + 1 < r.max_new_tokens and r.acceptance.rate() >= floor]

    def _decodes_step_time(self, decodes: Sequence[Request]) -> Callable[[int], float] | None:
        """A step of `decodes` alone with `extra` draft rows, as `_draft_step_time` prices it."""
        if self.step_time_model is None:
            return None
        kv = sum(r.num_computed for r in decodes)
        shape = StepShape(num_decodes=len(decodes), decode_kv=kv + len(decodes), num_sampled=len(decodes))
        return self._with_drafts(shape, kv // len(decodes))

    def set_proposals(self, request_id: Hashable, n: int) -> None:
        """Speculative decoding: the request has `n` proposed tokens for its next decode.
        The next schedule() verifies up to `n` of them if it decodes the request
        (PlanEntry.num_draft, as many as `speculation_lengths` allots from the budget,
        the TBT target and the request's acceptance so far), then forgets `n`: call it
        before every schedule()."""
        req = self._live.get(request_id)
        if req is None:
            raise ValueError(f"request_id {request_id!r} is not scheduled")
        req.proposals = non_negative_int("n", n)
        if n:
            self._proposed.append(req)

    def _add_drafts(self, b: StepBuilder, first: int) -> None:
        """Grow the decode entries from b.plan.entries[first] on by the proposals they
        verify. A verifying decode generates up to 1 + num_draft tokens, so it never
        verifies more than max_new_tokens leaves; proposals take budget after every
        decode's own token, and blocks beyond the watermark only (never a preemption)."""
        if not self._proposed:
            return
        entries = b.plan.entries[first:]
        reqs = b.reqs[first:]
        # Every decode is a candidate, with or without proposals: each one waits on the
        # step, which is what a draft's time costs in the rule.
        candidates = [SpecCandidate(max(0, min(req.proposals, req.max_new_tokens - req.num_generated - 1)),
                                    req.acceptance.rate()) for req in reqs]
        lengths = speculation_lengths(candidates, b.budget_left, step_time=self._draft_step_time(b, entries),
                                      time_target=self.config.tbt_slo,
                                      prefill_waiting=self._prefill_waiting(b.budget_left))
        bs = self.config.block_size
        spare = self._blocks.num_free - self.config.watermark_blocks
        for req, entry, d in zip(reqs, entries, lengths):
            d = min(d, (len(req.blocks) + max(spare, 0)) * bs - req.num_computed - 1)
            if d <= 0:
                continue
            need = self._blocks.blocks_for(req.num_computed + 1 + d) - len(req.blocks)
            if need > 0:
                req.blocks += self._blocks.take(need)
                spare -= need
            entry.num_tokens += d
            entry.num_draft = d
            b.plan.num_decode_tokens += d

    def _draft_step_time(self, b: StepBuilder, decodes: Sequence[PlanEntry]) -> Callable[[int], float] | None:
        """The step's predicted seconds with `extra` draft rows on `decodes` (priced as
        causal-chunk rows over their mean context, each sampled); None without a model,
        or one that cannot predict yet (an engine's before its first step)."""
        if self.step_time_model is None or not decodes:
            return None
        return self._with_drafts(StepShape.of_plan(b.plan), sum(e.start_pos for e in decodes) // len(decodes))

    def _with_drafts(self, shape: StepShape, context: int) -> Callable[[int], float] | None:
        """Seconds of a step of `shape` plus `extra` draft rows over `context` cached
        tokens each (StepShape.with_drafts); None when the model cannot predict yet."""
        model = self.step_time_model
        if model is None or not math.isfinite(model.predict_shape(shape)):
            return None
        return lambda extra: model.predict_shape(shape.with_drafts(extra, context))

    def _prefill_waiting(self, budget_left: int) -> int:
        """Prompt tokens waiting or mid-prefill, counted up to where the speculation rule
        stops telling them apart (budget_left**2: a displaced token's cost is capped)."""
        cap = max(budget_left, 1) ** 2
        total = 0
        for req in itertools.chain(self._running.values(), self._waiting):
            total += max(req.prefill_target - req.num_computed, 0)
            if total >= cap:
                break
        return total

    @staticmethod
    def _check_accepted(accepted: Mapping[Hashable, int], drafts: Mapping[Hashable, int],
                        token_ids: Mapping[Hashable, int | Sequence[int]] | None) -> Mapping[Hashable, int]:
        """`accepted` checked against the plan's verifying entries (`drafts`: their
        num_draft), and `token_ids` (its ids already checked) in the same pass: ints in
        [0, 2**63), as many as each request generated."""
        for request_id, n in accepted.items():
            if request_id not in drafts:
                raise ValueError(f"accepted names {request_id!r}, which verified no proposals in this plan")
            if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= drafts[request_id]:
                raise ValueError(f"accepted[{request_id!r}] must be an int in [0, {drafts[request_id]}], got {n!r}")
        for request_id, given in (token_ids or {}).items():
            tokens = generated_tokens(given)
            for t in tokens:
                if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < 1 << 63:
                    raise ValueError(f"token_ids must map to ints in [0, 2**63), got {t!r}")
            want = accepted.get(request_id, 0) + 1 if request_id in drafts else 1
            count = len(tokens)
            if count != want:
                raise ValueError(f"token_ids[{request_id!r}] holds {count} tokens; the request generated {want}")
        return accepted
