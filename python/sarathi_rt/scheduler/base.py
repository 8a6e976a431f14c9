"""Request lifecycle, KV blocks, preemption and in-flight plans: everything a policy
shares. A policy only decides which requests run how many tokens in one step."""
from __future__ import annotations

import math
import time
from abc import ABC, abstractmethod
from array import array
from collections import deque
from typing import ClassVar, Collection, Hashable, Mapping, Sequence

from .block_manager import BlockManager
from .config import SchedulerConfig
from .batch_plan import BatchPlan, PlanEntry, StepBuilder
from .prefix_cache import PrefixCacheStats, block_hashes, next_block_hash
from .qos import class_of
from .registry import get_policy
from .request import Request, RequestInfo, RequestStatus, generated_tokens
from .drafting import Drafting
from sarathi_rt.step_time import StepTimeModel
from sarathi_rt.utils.checks import positive_int

RUNNING = RequestStatus.RUNNING


class Scheduler(Drafting, ABC):
    """Base of every policy. Subclasses implement `_build` and may tighten
    `check_config` / `_check_fits`."""

    name: ClassVar[str] = ""
    chunked: ClassVar[bool] = True  # False: a prefill always runs whole in one step
    adaptive: ClassVar[bool] = False  # True: honours config.tbt_slo with a step-time model

    def __init__(self, config: SchedulerConfig, step_time_model: StepTimeModel | None = None) -> None:
        if config.needs_step_time_model and step_time_model is None:
            raise ValueError("step_time_model is required when tbt_slo is set (the adaptive budget) "
                             "or qos_policy is 'deadline' with qos_classes")
        self.config = config
        self.step_time_model = step_time_model
        self._blocks = BlockManager(config.num_blocks, config.block_size, config.enable_prefix_caching)
        self._live: dict[Hashable, Request] = {}
        # The requests given proposals (set_proposals) for the next schedule(), which
        # forgets them: with none, a step skips the speculation pass over its decodes.
        self._proposed: list[Request] = []
        self._done: dict[Hashable, Request] = {}  # kept for request_info until release
        self._waiting: deque[Request] = deque()  # sorted by arrival (FCFS)
        self._running: dict[Hashable, Request] = {}  # admission order == arrival order
        self._pending: dict[int, list[Request]] = {}  # step -> requests of that plan
        # Forks' (source, destination) blocks, for the next plan. A plan built later runs
        # after the copy on every worker, so a source freed meanwhile (its request
        # finished) can be reused by such a plan but is never written before it is copied.
        self._copies: list[tuple[int, int]] = []
        self._arrivals = 0
        self._step = 0
        self._now = 0.0  # seconds, as of the latest schedule(): what QoS deadlines compare to

    # ----------------------------------------------------------------- config
    @classmethod
    def check_config(cls, config: SchedulerConfig) -> None:
        """Raise ValueError for settings this policy can never honour."""
        # A hybrid step carries every running decode, one token each.
        if config.max_num_seqs > config.token_budget:
            raise ValueError(f"max_num_seqs ({config.max_num_seqs}) must not exceed "
                             f"token_budget ({config.token_budget}) for policy {cls.name!r}")

    def _check_fits(self, num_prompt_tokens: int, max_new_tokens: int) -> None:
        # The last generated token is never fed back, so its KV is never stored; a
        # recompute re-prefills at most prompt + max_new_tokens - 1 tokens.
        kv_tokens = num_prompt_tokens + max_new_tokens - 1
        need = self._blocks.blocks_for(kv_tokens)
        if need > self.config.num_blocks:
            raise ValueError(
                f"request needs {need} KV blocks (num_prompt_tokens={num_prompt_tokens} + "
                f"max_new_tokens={max_new_tokens}) but the cache has {self.config.num_blocks}")
        if not self.chunked and kv_tokens > self.config.token_budget:
            raise ValueError(
                f"policy {self.name!r} prefills whole sequences, but num_prompt_tokens="
                f"{num_prompt_tokens} + max_new_tokens={max_new_tokens} - 1 exceeds "
                f"token_budget ({self.config.token_budget})")

    # ------------------------------------------------------------- public API
    def add_request(self, request_id: Hashable, num_prompt_tokens: int, max_new_tokens: int, *,
                    prompt_token_ids: Sequence[int] | None = None, qos: str | None = None,
                    arrival_time: float | None = None, sample_ids: Sequence[Hashable] = ()) -> None:
        """Queue a request. With prefix caching on, `prompt_token_ids` let it reuse the
        KV of a cached prompt prefix: its first PlanEntry then starts at the number of
        tokens it skipped (whole blocks, never the last prompt token). `qos` names its
        class in config.qos_classes (default: config.default_qos); its deadlines count
        from `arrival_time` (seconds on the clock `schedule(now=...)` reads; default
        time.perf_counter()). `sample_ids`: the ids of more samples of the same prompt
        (n > 1), created by the update that completes its first prefill (see `_fork`);
        that update's `stopped` and `token_ids` may name them."""
        if request_id in self._live:
            raise ValueError(f"request_id {request_id!r} is already scheduled")
        sample_ids = tuple(sample_ids)
        if len({request_id, *sample_ids}) != len(sample_ids) + 1 or any(s in self._live for s in sample_ids):
            raise ValueError(f"sample_ids must be distinct ids, none scheduled nor {request_id!r}")
        qos, qos_class = class_of(self.config.qos_classes, self.config.default_qos, qos)
        if arrival_time is None:
            arrival_time = time.perf_counter()
        elif isinstance(arrival_time, bool) or not isinstance(arrival_time, (int, float)) or \
                not math.isfinite(arrival_time):
            raise ValueError(f"arrival_time must be a finite number of seconds, got {arrival_time!r}")
        positive_int("num_prompt_tokens", num_prompt_tokens)
        positive_int("max_new_tokens", max_new_tokens)
        self._check_fits(num_prompt_tokens, max_new_tokens)
        keys, tail = self._prompt_keys(num_prompt_tokens, prompt_token_ids)
        self._done.pop(request_id, None)
        req = Request(request_id, num_prompt_tokens, max_new_tokens, self._arrivals,
                      prefill_target=num_prompt_tokens, block_keys=keys, key_tail=tail, arrival_step=self._step,
                      qos=qos, qos_class=qos_class, arrival_time=float(arrival_time), samples=sample_ids)
        self._arrivals += 1
        self._live[request_id] = req
        self._waiting.append(req)

    def schedule(self, now: float | None = None) -> BatchPlan:
        """Build the next step. Requests in a plan stay out of later plans until that
        plan is passed to `update`, so several plans may be in flight (pipelining).
        `now`: seconds on the clock of add_request's arrival_time (default
        time.perf_counter()); QoS deadlines are weighed against it."""
        self._now = time.perf_counter() if now is None else now
        self._step += 1
        b = StepBuilder(self._step, self.config.token_budget)
        self._build(b)
        # Prefills in progress may all wait on blocks that only they hold; with no
        # decode to free any, preempt the newest until the oldest can move. One
        # request alone always moves (add_request checked it fits the whole cache).
        while not b.reqs and not self._pending and len(self._running) > 1:
            self._preempt(next(reversed(self._running.values())), b)
            self._build(b)
        plan = b.plan
        plan.block_copies, self._copies = self._copies, []
        tile = self.config.tile_size
        if tile:
            plan.tile_padding = -plan.num_tokens % tile
        self._pending[plan.step] = b.reqs
        for req in self._proposed:
            req.proposals = 0
        self._proposed.clear()
        return plan

    def update(self, plan: BatchPlan, stopped: Collection[Hashable] = (),
               token_ids: Mapping[Hashable, int | Sequence[int]] | None = None,
               accepted: Mapping[Hashable, int] | None = None) -> list[Hashable]:
        """Complete `plan`: advance prefills, count the token each emitting entry
        sampled, finish requests that reached max_new_tokens or are in `stopped`.
        `token_ids`: the token each emitting request sampled; with prefix caching, the
        full blocks they fill are keyed and cached once their KV is computed (a request
        whose token is not given stops being keyed). `accepted`: for each entry that
        verified proposals (num_draft > 0), how many of them were accepted (0 when not
        named): the request advances by 1 + accepted tokens, generates accepted + 1
        (its token_ids entry then lists them in order), and the blocks only its
        rejected proposals needed are freed. Returns the ids that finished."""
        reqs = self._pending.get(plan.step)
        if reqs is None:
            raise ValueError(f"plan for step {plan.step} is not in flight "
                             "(already updated, or from another scheduler)")
        if isinstance(stopped, (str, bytes)) or not isinstance(stopped, Collection):
            # a str is a collection of its characters: "a" would stop request "a" by luck
            raise TypeError(f"stopped must be a collection of request ids, got {stopped!r}")
        if stopped or token_ids:  # the requests that sampled, with the samples a fork creates
            sampled = {e.request_id for e in plan.entries if e.emits_token}
            sampled.update(s for req, e in zip(reqs, plan.entries) if e.emits_token for s in req.samples)
        if stopped:
            stopped = set(stopped)
            bad = stopped - sampled
            if bad:
                raise ValueError(f"stopped names requests that sampled no token in this "
                                 f"plan: {sorted(map(repr, bad))}")
        if token_ids:
            bad = set(token_ids) - sampled
            if bad:
                raise ValueError(f"token_ids names requests that sampled no token in this "
                                 f"plan: {sorted(map(repr, bad))}")
        drafts = {e.request_id: e.num_draft for e in plan.entries if e.num_draft}
        accepted = self._check_accepted(accepted or {}, drafts, token_ids)
        del self._pending[plan.step]
        finished = []
        for req, entry in zip(reqs, plan.entries):
            req.in_flight = False
            if req.status is not RUNNING:  # aborted while in flight
                self._blocks.release(req.blocks)
                continue
            kept = accepted.get(req.request_id, 0)
            req.num_computed += entry.num_tokens - entry.num_draft + kept
            if entry.num_draft:
                req.acceptance.record(entry.num_draft, kept)
                # The blocks only rejected drafts needed; their slots in the blocks kept are
                # overwritten later (attention never reads past num_computed).
                self._blocks.truncate(req.blocks, req.num_computed)
            if req.num_keyed < len(req.block_keys):
                self._register_computed(req)
            if entry.emits_token:
                req.num_generated += 1 + kept
                if req.samples:  # before the parent may retire and free the prompt's blocks
                    finished += self._fork(req, stopped, token_ids)
                if req.key_tail is not None:
                    given = None if token_ids is None else token_ids.get(req.request_id)
                    for token in generated_tokens(given):
                        self._key_generated(req, token)
                if req.num_generated >= req.max_new_tokens or \
                        (stopped and req.request_id in stopped):
                    self._retire(req, RequestStatus.FINISHED)
                    finished.append(req.request_id)
        return finished

    def _fork(self, parent: Request, stopped: Collection[Hashable],
              token_ids: Mapping[Hashable, int] | None) -> list[Hashable]:
        """Create `parent`'s other samples: its prompt's KV is computed and each sample
        has drawn its first token from the prompt's last logits (the engine sampled them
        in the same step). A sample shares the prompt's full blocks (one more reference
        each) and owns a copy of the partly filled last one (plan.block_copies); with
        prefix caching it keys its own tokens from there, as the parent does (called
        before the parent keys its first token, so parent.key_tail is the prompt's). One that
        finds no room (max_num_seqs reached, or no free block for the copy) waits at the
        front of the queue like a preempted request and re-prefills the prompt and its
        first token: its tokens are the same, only that prefill is paid again. Returns
        the samples that finished with their first token."""
        bs = self.config.block_size
        prompt = parent.num_prompt_tokens
        full, partial = divmod(prompt, bs)
        keys, tail = parent.block_keys[:full], parent.key_tail
        room = self.config.max_num_seqs - len(self._running)
        finished, deferred = [], []
        for sample_id in parent.samples:
            child = Request(sample_id, prompt, parent.max_new_tokens, parent.arrival, prefill_target=prompt,
                            num_computed=prompt, num_generated=1, first_scheduled_step=parent.first_scheduled_step,
                            block_keys=list(keys), num_keyed=len(keys), arrival_step=parent.arrival_step,
                            qos=parent.qos, qos_class=parent.qos_class, arrival_time=parent.arrival_time,
                            relegated=parent.relegated, key_tail=None if tail is None else list(tail))
            if tail is not None:
                self._key_generated(child, None if token_ids is None else token_ids.get(sample_id))
            if child.num_generated >= child.max_new_tokens or sample_id in stopped:
                child.status = RequestStatus.FINISHED
                self._done[sample_id] = child
                finished.append(sample_id)
                continue
            self._live[sample_id] = child
            if room > 0 and (not partial or self._blocks.num_free > 0):
                child.status = RUNNING
                child.blocks = self._blocks.share(parent.blocks[:full])
                if partial:
                    child.blocks += self._blocks.take(1)
                    self._copies.append((parent.blocks[full], child.blocks[full]))
                self._running[sample_id] = child
                room -= 1
            else:
                child.num_computed = child.num_keyed = 0
                child.prefill_target = prompt + 1
                deferred.append(child)
        self._waiting.extendleft(reversed(deferred))
        parent.samples = ()
        return finished

    def _prompt_keys(self, num_prompt_tokens: int, prompt_token_ids: Sequence[int] | None
                     ) -> tuple[list[bytes], list[int] | None]:
        """The keys of the prompt's full blocks and the tokens after them (None: not keyed)."""
        if prompt_token_ids is None:
            return [], None
        if len(prompt_token_ids) != num_prompt_tokens:
            raise ValueError(f"prompt_token_ids has {len(prompt_token_ids)} ids but "
                             f"num_prompt_tokens is {num_prompt_tokens}")
        if not self._blocks.caching:
            return [], None
        try:
            ids = array("q", prompt_token_ids)
        except (TypeError, OverflowError):
            raise ValueError("prompt_token_ids must hold ints that fit in 64 bits") from None
        keys = block_hashes(ids, self.config.block_size)
        return keys, ids[len(keys) * self.config.block_size:].tolist()

    def _key_generated(self, req: Request, token: int | None) -> None:
        """Extend `req`'s keys by its sampled `token`; its block is registered (in a later
        update) once the KV of all its tokens is computed, the last one when fed back."""
        tail = req.key_tail
        if token is None or tail is None:
            req.key_tail = None  # unknown from here on: a wrong key would share wrong KV
            return
        tail.append(token)
        if len(tail) == self.config.block_size:
            req.block_keys.append(next_block_hash(req.block_keys[-1] if req.block_keys else None, tail))
            tail.clear()

    def abort(self, request_id: Hashable) -> bool:
        """Drop a request in any state; False if it is not live. The blocks of a
        request inside an un-updated plan are freed by that plan's update, because
        the engine may still be writing them."""
        req = self._live.get(request_id)
        if req is None:
            return False
        if req.status is RequestStatus.WAITING:
            self._waiting.remove(req)
        self._retire(req, RequestStatus.ABORTED)
        return True

    def drop_plans_in_flight(self) -> None:
        """Forget every plan in flight, which will never be updated (the executor that ran
        them failed); their aborted requests' blocks come back. Abort the requests first."""
        for reqs in self._pending.values():
            for req in reqs:
                req.in_flight = False
                if req.status is not RUNNING:
                    self._blocks.release(req.blocks)
        self._pending.clear()

    def has_unfinished(self) -> bool:
        return bool(self._live)

    @property
    def num_free_blocks(self) -> int:
        """Blocks a request can get: never-used or freed ones plus cached blocks that
        no request references (evicted on demand)."""
        return self._blocks.num_free

    @property
    def num_cached_free_blocks(self) -> int:
        """Of num_free_blocks, those still holding a cached prefix."""
        return self._blocks.num_cached_free

    def prefix_cache_stats(self) -> PrefixCacheStats:
        """Prompt tokens looked up, served from the cache, and blocks evicted so far."""
        return self._blocks.stats()

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_plans_in_flight(self) -> int:
        return len(self._pending)

    def block_table(self, request_id: Hashable) -> list[int]:
        """Physical KV block ids of a live request, in sequence order (a copy)."""
        return list(self._live[request_id].blocks)

    def request_info(self, request_id: Hashable) -> RequestInfo:
        """Snapshot of a live request, or of a finished/aborted one until `release`."""
        req = self._live.get(request_id) or self._done.get(request_id)
        if req is None:
            raise KeyError(request_id)
        return req.info()

    def release(self, request_id: Hashable) -> None:
        """Forget a finished or aborted request's info (long-running servers)."""
        self._done.pop(request_id, None)

    # ------------------------------------------------------- for the policies
    @abstractmethod
    def _build(self, b: StepBuilder) -> None:
        """Add entries to `b` (via the helpers below); may be called again on the same
        builder after a preemption."""

    def _split_running(self) -> tuple[list[Request], list[Request]]:
        """Running requests that are not in flight: (decodes, prefills), by arrival."""
        decodes, prefills = [], []
        for req in self._running.values():
            if not req.in_flight:
                (prefills if req.num_computed < req.prefill_target else decodes).append(req)
        return decodes, prefills

    def _add(self, b: StepBuilder, req: Request, n: int) -> None:
        start = req.num_computed
        plan = b.plan
        if start < req.prefill_target:
            plan.entries.append(PlanEntry(req.request_id, start, n, True,
                                          start + n == req.prefill_target))
            plan.num_prefill_tokens += n
        else:
            plan.entries.append(PlanEntry(req.request_id, start, n, False, True))
            plan.num_decode_tokens += n
        req.in_flight = True
        if req.first_scheduled_step is None:
            req.first_scheduled_step = plan.step
        b.reqs.append(req)

    def _schedule_decodes(self, b: StepBuilder, decodes: list[Request]) -> None:
        """One token for each decode, preempting the newest running requests by
        recompute when the cache has no block for a decode that needs one; then the
        proposals they verify (speculative decoding, see `_add_drafts`)."""
        bs = self.config.block_size
        first = len(b.plan.entries)
        needy = [r for r in decodes if len(r.blocks) * bs <= r.num_computed]
        if len(needy) <= self._blocks.num_free:
            if needy:
                for req, block in zip(needy, self._blocks.take(len(needy))):
                    req.blocks.append(block)
            for req in decodes:
                self._add(b, req, 1)
        else:
            for req in decodes:
                if req.status is not RUNNING:  # preempted for an earlier decode
                    continue
                if len(req.blocks) * bs <= req.num_computed:
                    while self._blocks.num_free == 0 and req.status is RUNNING:
                        self._preempt(self._victim(), b)
                    if req.status is not RUNNING:
                        continue
                    req.blocks.extend(self._blocks.take(1))
                self._add(b, req, 1)
        self._add_drafts(b, first)

    def _victim(self) -> Request:
        """The running request outside every plan to preempt: the most recently arrived;
        with deadline-aware QoS, a relegated one first, then the lowest priority, then
        the one whose next token is due last (so the tight classes keep their blocks)."""
        idle = [r for r in reversed(self._running.values()) if not r.in_flight]
        if not idle:
            raise AssertionError("a decode needing a block is itself idle")
        if not self.config.deadline_aware:
            return idle[0]
        # min() keeps the first of equals: the newest
        return min(idle, key=lambda r: (not r.relegated, r.qos_class.priority,  # type: ignore[union-attr]
                                        -r.next_deadline()))

    def _prefill_chunk(self, b: StepBuilder, req: Request, cap: int,
                       keep_free: int = 0) -> int:
        """Tokens of `req`'s prefill that fit this step: at most `cap`, the budget left
        and what the cache can hold beyond `keep_free` blocks; trimmed to a tile
        boundary of the whole step when cut short. 0 if nothing fits. For the waiting
        head, its matched cached prefix counts as computed and held."""
        left = req.prefill_left
        start = req.prefill_target - left
        held = len(req.blocks) + len(req.matched)
        room = (held + self._blocks.num_free - req.matched_idle - keep_free) * self.config.block_size
        n = min(left, cap, b.budget_left, room - start)
        tile = self.config.tile_size
        if tile and 0 < n < left:
            before = b.plan.num_prefill_tokens + b.plan.num_decode_tokens
            aligned = (before + n) // tile * tile
            if aligned > before:
                n = aligned - before
        return max(n, 0)

    def _run_prefill(self, b: StepBuilder, req: Request, n: int) -> None:
        """Reserve blocks for `n` more prefill tokens (checked by _prefill_chunk)."""
        grown = self._blocks.grow(req.blocks, req.num_computed + n)
        assert grown, "_prefill_chunk promised the blocks"
        self._add(b, req, n)

    def _admit_keep_free(self) -> int:
        # The watermark only protects running requests; an empty cache admits anyone.
        return self.config.watermark_blocks if self._running else 0

    def _waiting_head(self) -> Request:
        """The head of the queue with its cached prompt prefix matched (taken only by
        `_admit`). Policies read the head through this before sizing its chunk."""
        req = self._waiting[0]
        if req.block_keys:
            # The last prompt token is always computed, so the request gets its logits.
            limit = (req.prefill_target - 1) // self.config.block_size
            req.matched, req.matched_idle = self._blocks.match(req.block_keys, limit)
            req.matched_tokens = len(req.matched) * self.config.block_size
        return req

    def _admit(self, b: StepBuilder, n: int) -> None:
        """Move the head of the queue to running and give it `n` prefill tokens (after
        its cached prefix, which it now shares)."""
        # Match again: within a build nothing evicts between sizing and admitting, but a
        # policy that sized the chunk from self._waiting[0] must not take stale blocks.
        req = self._waiting_head()
        self._waiting.popleft()
        req.status = RUNNING
        self._running[req.request_id] = req
        if self._blocks.caching:
            self._blocks.reuse(req.matched, req.prefill_target)
            req.blocks, req.num_computed, req.num_keyed = req.matched, req.matched_tokens, len(req.matched)
            req.matched, req.matched_tokens, req.matched_idle = [], 0, 0
            if req.num_preemptions == 0:
                req.num_cached_tokens = req.num_computed
        self._run_prefill(b, req, n)

    def _register_computed(self, req: Request) -> None:
        """Publish the prompt blocks whose KV the request has now fully computed."""
        full = min(req.num_computed // self.config.block_size, len(req.block_keys))
        for i in range(req.num_keyed, full):
            self._blocks.register(req.blocks[i], req.block_keys[i])
        req.num_keyed = max(req.num_keyed, full)

    def _admit_whole_prompts(self, b: StepBuilder) -> None:
        """FCFS admission of whole prefills (the unchunked policies)."""
        while b.admission_open and self._waiting and \
                len(self._running) < self.config.max_num_seqs:
            req = self._waiting_head()
            left = req.prefill_left
            if self._prefill_chunk(b, req, left, self._admit_keep_free()) < left:
                return
            self._admit(b, left)

    def _preempt(self, req: Request, b: StepBuilder) -> None:
        """Preemption by recompute: free the KV, requeue at the front; it later
        re-prefills prompt + generated tokens (which are kept)."""
        self._blocks.release(req.blocks)
        del self._running[req.request_id]
        req.status = RequestStatus.WAITING
        req.num_computed = req.num_keyed = 0
        req.prefill_target = req.num_prompt_tokens + req.num_generated
        req.num_preemptions += 1
        self._waiting.appendleft(req)
        b.plan.preempted.append(req.request_id)

    def _retire(self, req: Request, status: RequestStatus) -> None:
        if req.status is RUNNING:
            del self._running[req.request_id]
            if not req.in_flight:
                self._blocks.release(req.blocks)
        req.status = status
        del self._live[req.request_id]
        self._done[req.request_id] = req


def create_scheduler(config: SchedulerConfig, step_time_model: StepTimeModel | None = None) -> Scheduler:
    """The policy's scheduler; `step_time_model` sizes each step when config.tbt_slo is set."""
    scheduler: Scheduler = get_policy(config.policy)(config, step_time_model)  # type: ignore[operator]
    return scheduler
