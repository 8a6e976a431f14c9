"""The driver: requests in, a BatchPlan per step, StepInputs to the executor, tokens out."""
from __future__ import annotations

import itertools
import math
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Hashable

from sarathi_rt.measure.metrics import RequestMetrics, StageMetrics, StepMetrics, pipeline_wait
from sarathi_rt.models import ResolvedModel, resolve_configured
from sarathi_rt.utils.nvtx import nvtx_range
from sarathi_rt.sampling import SamplingParams, as_int, sample_seed
from sarathi_rt.scheduler import BatchPlan, PrefixCacheStats, create_scheduler
from sarathi_rt.spec import Proposer, create_proposer
from sarathi_rt.step_time.shape import StepShape
from sarathi_rt.step_time.online import OnlineStepTimeModel

from sarathi_rt.config import EngineConfig
from sarathi_rt.text.detokenizer import Detokenizer, TextDecoder
from .draft import DraftProposer, resolve_draft
from .executor import Executor, InProcessExecutor
from .outputs import RequestOutput
from .sequence import SequenceState
from .step_io import SequenceChunk, StepInput, StepOutput
from .structured import GrammarCompiler
from .tiles import resolve_tile_size


class LLMEngine:
    """Owns the scheduler, the requests, their sampling settings, outputs and metrics;
    the executor owns the model. `step()` runs one scheduler step end to end.

    Bad requests raise from add_request/abort (ValueError or TypeError naming the
    argument) and leave the engine and every other request untouched.

    With pipeline parallelism the engine keeps as many plans (micro-batches) in flight
    as the executor has stages, a request in at most one of them; each step() then
    completes the oldest. `stage_metrics` gets each stage's busy/idle time per step.

    `step_metrics` / `stage_metrics` keep the latest METRICS_WINDOW entries, so a
    long-running engine does not grow without bound; `num_steps` counts every step and
    `steps_since(n)` returns the steps after the n-th; `num_preemptions` counts every
    preemption of a sample; `num_draft_tokens` / `num_accepted_tokens` every proposal
    verified / accepted.

    With a `tokenizer` each output carries its text, decoded incrementally, and requests
    can stop at strings (SamplingParams.stop).

    A request with SamplingParams(n > 1) is n samples: sample 0 is scheduled under the
    request's id and prefilled alone; the step that completes its prompt draws every
    sample's first token from the prompt's last logits row (sample i with seed
    sample_seed(seed, i)), and the scheduler then forks samples 1..n-1 onto the prompt's
    KV blocks (see Scheduler._fork). Each output carries its sample's `index`; `abort`
    and `has_request` take the request's id and cover every sample.

    With config.speculative_method set, each step first asks the proposer for every
    decoding sample's guesses, all samples in one call (a draft model batches them; a
    sample with a json_schema keeps those before the first its grammar refuses); the
    scheduler gives a decode 1 + d rows for d of them (with a grammar, each row masked as
    of its own position), the sampler keeps those the model agrees with, and the sample
    gets every kept token in order, each through the same stop, length, grammar and
    logprob handling as one token."""

    METRICS_WINDOW = 65536

    def __init__(self, config: EngineConfig, executor: Executor | None = None,
                 tokenizer: TextDecoder | None = None,
                 step_observer: Callable[[BatchPlan, float], None] | None = None,
                 model: ResolvedModel | None = None) -> None:
        self.config = config
        # Called with each finished step's plan and its measured seconds: how tools such
        # as the simulator-fidelity bench see the shapes the engine ran (None: no cost).
        self.step_observer = step_observer
        self.tokenizer = tokenizer
        # config.model looked up once (or by the caller: `model`); the executor's workers get it.
        self.model = resolve_configured(config) if model is None else model
        self.model_config = self.model.config
        self.max_model_len = config.model_len(self.model_config)
        # The draft model is looked up and checked against the target before any weights load.
        draft = resolve_draft(config, self.model, tokenizer) if config.speculative_method == "draft" else None
        self.executor = executor if executor is not None else _default_executor(config, self.model)
        self.scheduler_config = config.scheduler_config(
            self.executor.num_kv_blocks, resolve_tile_size(config.tile_size, self.model_config, config))
        # Speculative decoding: proposals per decode, verified in the hybrid batch.
        self.proposer: Proposer | None = create_proposer(
            config.speculative_method, config.speculative_k, config.speculative_ngram_min,
            config.speculative_ngram_max) if draft is None else \
            DraftProposer(config, draft, config.speculative_k, self.executor.num_kv_blocks,
                          self.scheduler_config.token_budget)
        # The adaptive budget's step-time model learns from every step this engine runs;
        # speculation weighs a proposal's row against the time it adds to the step.
        self.step_time_model = OnlineStepTimeModel() \
            if self.scheduler_config.needs_step_time_model or self.proposer is not None else None
        self.scheduler = create_scheduler(self.scheduler_config, self.step_time_model)
        self.step_metrics: deque[StepMetrics] = deque(maxlen=self.METRICS_WINDOW)
        self.stage_metrics: deque[StageMetrics] = deque(maxlen=self.METRICS_WINDOW)
        self.num_steps = 0
        self.num_preemptions = 0
        # Speculative decoding, over every step: proposals verified, and of them accepted.
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        # Each plan in flight keeps the SequenceState of every entry: a request aborted (and
        # its id reused) while the plan runs must not receive that plan's token.
        # The samples that draw a token (SequenceChunk.rows) ride along, in row order.
        self._in_flight: deque[tuple[BatchPlan, list[SequenceState], list[SequenceState], float]] = deque()
        self._failure: BaseException | None = None
        self._seqs: dict[Hashable, SequenceState] = {}  # live samples by scheduler id (SequenceState.key)
        self._requests: dict[Hashable, list[SequenceState]] = {}  # request id -> its samples, by index
        self._aborted: list[RequestOutput] = []
        self._seed_rng = random.Random(config.seed)
        self._grammar_compiler: GrammarCompiler | None = None  # built by the first json_schema
        self._grammar_lock = threading.Lock()  # compile_grammar may run on other threads

    # ----------------------------------------------------------------- requests
    def add_request(self, request_id: Hashable, prompt: Sequence[int], params: SamplingParams | None = None,
                    arrival_time: float | None = None, qos: str | None = None) -> None:
        """Queue a prompt (token ids). arrival_time defaults to now (time.perf_counter).
        `qos` names the request's QoS class (config.qos_classes; default
        config.default_qos). Everything is checked before the request is registered, so
        a bad one leaves no trace."""
        try:
            hash(request_id)
        except TypeError:
            raise TypeError(f"request_id must be hashable, got {type(request_id).__name__}") from None
        self._check_alive()
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        if params.stop and self.tokenizer is None:
            raise ValueError("params.stop (stop strings) needs a tokenizer; this engine has none")
        tokens = self._check_prompt(prompt)
        if arrival_time is None:
            arrival_time = time.perf_counter()
        elif isinstance(arrival_time, bool) or not isinstance(arrival_time, (int, float)) \
                or not math.isfinite(arrival_time):
            raise ValueError(f"arrival_time must be a finite number of seconds, got {arrival_time!r}")
        vocab = self.model_config.vocab_size
        bad = [t for t in params.stop_token_ids if t >= vocab]
        if bad:
            raise ValueError(f"params.stop_token_ids holds {bad[0]}, outside the vocabulary [0, {vocab})")
        stops = set(params.stop_token_ids)
        if not params.ignore_eos:
            stops.update(self.model_config.eos_token_ids)
        max_new = min(params.max_tokens, self.max_model_len - len(tokens))
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        seqs = [self._sequence(request_id, i, tokens, params, sample_seed(seed, i), max_new, frozenset(stops),
                               float(arrival_time)) for i in range(params.n)]
        # Prompt logprobs need every prompt position's logits: no cached prefix for them.
        cache_keys = tokens if params.prompt_logprobs is None else None
        self.scheduler.add_request(request_id, len(tokens), max_new, prompt_token_ids=cache_keys,  # last: it may refuse
                                   qos=qos, arrival_time=float(arrival_time), sample_ids=[q.key for q in seqs[1:]])
        qos = self.scheduler.request_info(request_id).qos  # default_qos applied
        for seq in seqs:
            seq.metrics.qos = qos
            self._seqs[seq.key] = seq
        self._requests[request_id] = seqs

    def _sequence(self, request_id: Hashable, index: int, tokens: list[int], params: SamplingParams, seed: int,
                  max_new: int, stops: frozenset[int], arrival_time: float) -> SequenceState:
        metrics = RequestMetrics(arrival_time=arrival_time, num_prompt_tokens=len(tokens))
        detokenizer = None if self.tokenizer is None else \
            Detokenizer(self.tokenizer, tokens, params.skip_special_tokens, params.stop)
        # Each sample follows the schema's grammar from its start (one compile: cached).
        grammar = None if params.json_schema is None else self._compiler().grammar(params.json_schema, stops)
        return SequenceState(request_id, tokens, params, seed, max_new, stops, metrics,
                             logprobs=None if params.logprobs is None else [], detokenizer=detokenizer,
                             prompt_logprobs=None if params.prompt_logprobs is None else [None], index=index,
                             grammar=grammar)

    def compile_grammar(self, schema: str) -> None:
        """Compile SamplingParams.json_schema `schema` now, from any thread, so that adding
        a request with it compiles nothing (compiled schemas are cached): AsyncLLMEngine
        calls it off the event loop. Raises as add_request would for that schema."""
        self._compiler().compile(schema)

    def grammar_compiled(self, schema: str) -> bool:
        """Whether compile_grammar(`schema`) would return at once, from the cache."""
        with self._grammar_lock:
            return self._grammar_compiler is not None and self._grammar_compiler.cached(schema)

    def _compiler(self) -> GrammarCompiler:
        """Built once, on the first json_schema: an engine without any never needs xgrammar."""
        with self._grammar_lock:
            if self._grammar_compiler is None:
                self._grammar_compiler = GrammarCompiler(self.tokenizer, self.model_config.vocab_size,
                                                         tuple(self.model_config.eos_token_ids))
            return self._grammar_compiler

    def _check_prompt(self, prompt: object) -> list[int]:
        if hasattr(prompt, "tolist"):  # a tensor or an array of ids
            prompt = prompt.tolist()
        if isinstance(prompt, (str, bytes)) or not isinstance(prompt, Sequence):
            raise TypeError(f"prompt must be a sequence of token ids, got {type(prompt).__name__}")
        tokens = [as_int("prompt token ids", t) for t in prompt]
        if not tokens:
            raise ValueError("prompt must not be empty")
        if len(tokens) >= self.max_model_len:
            raise ValueError(f"prompt has {len(tokens)} tokens; the model's context (max_model_len="
                             f"{self.max_model_len}) leaves no room to generate")
        vocab = self.model_config.vocab_size
        if min(tokens) < 0 or max(tokens) >= vocab:
            bad = next(t for t in tokens if not 0 <= t < vocab)
            raise ValueError(f"prompt holds token id {bad}, outside the vocabulary [0, {vocab})")
        return tokens

    def abort(self, request_id: Hashable) -> None:
        """Stop a request (every unfinished sample of it) now; the next step() reports
        each with finish_reason "abort"."""
        seqs = self._requests.pop(request_id, None)
        if seqs is None:
            raise ValueError(f"request_id {request_id!r} is not running (unknown, finished or aborted)")
        now = time.perf_counter()
        for seq in seqs:
            if self._seqs.pop(seq.key, None) is None:  # this sample already finished
                continue
            self.scheduler.abort(seq.key)  # False for a sample not forked yet
            self.scheduler.release(seq.key)
            if self.proposer is not None:
                self.proposer.release(seq.key)
            seq.finish_reason = "abort"
            seq.metrics.finish_time = now
            self._aborted.append(seq.to_output(0))

    def has_request(self, request_id: Hashable) -> bool:
        """True while some sample of the request is queued or running."""
        return request_id in self._requests

    def has_unfinished(self) -> bool:
        return bool(self._seqs) or bool(self._aborted) or bool(self._in_flight)

    @property
    def num_unfinished(self) -> int:
        """Requests with a sample queued or running."""
        return len(self._requests)

    def steps_since(self, num_steps: int) -> list[StepMetrics]:
        """The metrics of the steps after the first `num_steps` (a past `self.num_steps`)."""
        count = self.num_steps - num_steps
        if not 0 <= count <= len(self.step_metrics):
            raise ValueError(f"steps after {num_steps} are not all in the window of the last "
                             f"{len(self.step_metrics)} of {self.num_steps} steps")
        return list(itertools.islice(self.step_metrics, len(self.step_metrics) - count, None))

    # --------------------------------------------------------------------- steps
    def step(self) -> list[RequestOutput]:
        """One step: schedule, run the model, sample; returns an output for every request
        that got a token, finished, or was aborted since the last step."""
        self._check_alive()
        outputs, self._aborted = self._aborted, []
        try:
            with nvtx_range("step"):
                while len(self._in_flight) < self.executor.pipeline_depth and self._submit_next():
                    pass
                if self._in_flight:
                    plan, seqs, rows, start = self._in_flight.popleft()
                    outputs += self._process(plan, seqs, rows, self.executor.collect(), start)
        except Exception as exc:  # the plans in flight are lost: the engine cannot go on
            self._fail(exc)
            raise
        return outputs

    @property
    def failure(self) -> BaseException | None:
        """What stopped the engine (a step's exception: a worker died, the model raised),
        None while it runs. After it every request has ended and every KV block is free."""
        return self._failure

    def _fail(self, exc: BaseException) -> None:
        """End every request and free its blocks: the plans in flight will never come back,
        and the caller reports `exc` to the requests instead of an abort."""
        self._failure = exc
        for request_id in list(self._requests):
            self.abort(request_id)
        self._aborted.clear()
        self._in_flight.clear()
        self.scheduler.drop_plans_in_flight()

    def _check_alive(self) -> None:
        if self._failure is not None:
            raise RuntimeError(f"the engine stopped after its executor failed: {self._failure}") \
                from self._failure

    def _submit_next(self) -> bool:
        """Schedule a plan and start it on the executor; False if nothing could run."""
        start = time.perf_counter()
        if self.proposer is not None:
            self._propose()
        with nvtx_range("schedule"):
            plan = self.scheduler.schedule(start)
        for request_id in plan.preempted:
            self._seqs[request_id].metrics.num_preemptions += 1
            if self.proposer is not None:  # a draft model's cache frees the sample's blocks
                self.proposer.release(request_id)
        self.num_preemptions += len(plan.preempted)
        for key in plan.relegated:
            # A request is relegated before its first token, so before its other samples
            # are forked (the scheduler's copies inherit it): mark every sample here.
            for seq in self._requests[self._seqs[key].request_id]:
                seq.metrics.relegated = True
        if plan.is_empty:
            self.scheduler.update(plan)
            return False
        seqs = [self._seqs[e.request_id] for e in plan.entries]
        step, rows = self._step_input(plan, seqs, start)
        self.executor.submit(step)
        self._in_flight.append((plan, seqs, rows, start))
        return True

    def _propose(self) -> None:
        """Proposals for the next plan, from the decodes the scheduler could allot drafts
        to (Scheduler.speculation_candidates: none with many decodes, so such steps pay
        nothing for speculating). At most max_tokens - 1 beyond the output: a decode
        generates its accepted proposals and one token more."""
        assert self.proposer is not None
        with nvtx_range("propose"):
            seqs = [self._seqs[key] for key in self.scheduler.speculation_candidates()]
            rooms = [seq.max_new_tokens - len(seq.output) - 1 for seq in seqs]
            for seq, draft in zip(seqs, self.proposer.propose_batch(seqs, rooms)):
                if seq.grammar is not None:  # a refused token could never be kept, nor the ones after it
                    draft = seq.grammar.cut(draft)
                seq.draft = draft
                self.scheduler.set_proposals(seq.key, len(draft))

    def prefix_cache_stats(self) -> PrefixCacheStats:
        """Prompt tokens looked up and served from the prefix cache, and evictions."""
        return self.scheduler.prefix_cache_stats()

    def shutdown(self) -> None:
        """Stop the executor's workers (idempotent); the engine cannot step afterwards."""
        self.executor.shutdown()

    def _step_input(self, plan: BatchPlan, seqs: list[SequenceState], start: float
                    ) -> tuple[StepInput, list[SequenceState]]:
        """The step for the executor, and the samples its rows draw tokens for."""
        chunks, rows = [], []
        block_table = self.scheduler.block_table
        for e, seq in zip(plan.entries, seqs):
            pos = e.start_pos
            prompt_len = len(seq.prompt)
            if e.num_draft:  # a decode verifying its proposals after its last token
                draft = seq.draft[:e.num_draft]
                chunks.append(SequenceChunk(e.request_id, [seq.output[pos - prompt_len], *draft],
                                            pos, block_table(e.request_id), seq.row_sampling(), num_draft=e.num_draft,
                                            draft_allowed=() if seq.grammar is None else
                                            tuple(seq.grammar.allowed_after(draft))))
                rows.append(seq)
                continue
            if e.num_tokens == 1 and pos >= prompt_len:
                # One token past the prompt (a decode, or a recompute's last token): it
                # was sampled before, scores no prompt token and forks nothing. The
                # common case, built without the general path's per-request calls.
                sampling = seq.row_sampling() if e.emits_token else None
                chunks.append(SequenceChunk(e.request_id, [seq.output[pos - prompt_len]], pos,
                                            block_table(e.request_id), sampling))
                if sampling is not None:
                    rows.append(seq)
                continue
            if seq.metrics.first_scheduled_time is None:
                seq.metrics.first_scheduled_time = start
                seq.metrics.num_cached_tokens = pos  # what the prefix cache skipped
            chunk = SequenceChunk(e.request_id, seq.tokens(pos, e.num_tokens), pos, block_table(e.request_id),
                                  seq.row_sampling() if e.emits_token else None,
                                  seq.prompt_targets(pos, e.num_tokens), seq.params.prompt_logprobs or 0)
            chunks.append(chunk)
            if e.emits_token:
                rows.append(seq)
                if seq.params.n > 1 and seq.index == 0 and not seq.output:  # the prompt is done: fork
                    forks = self._requests[seq.request_id][1:]
                    chunk.forks = [f.row_sampling() for f in forks]
                    rows += forks
                    for f in forks:
                        f.metrics.first_scheduled_time = seq.metrics.first_scheduled_time
                        f.metrics.num_cached_tokens = seq.metrics.num_cached_tokens
        return StepInput(plan.step, chunks, plan.block_copies), rows

    def _process(self, plan: BatchPlan, seqs: list[SequenceState], rows: list[SequenceState], out: StepOutput,
                 start: float) -> list[RequestOutput]:
        now = time.perf_counter()
        per_row = out.tokens_per_row or [1] * len(rows)
        if len(per_row) != len(rows) or len(out.token_ids) != sum(per_row):
            raise RuntimeError(f"executor returned {len(out.token_ids)} tokens in {len(per_row)} rows for "
                               f"{len(rows)} rows")
        drafts = {e.request_id: e.num_draft for e in plan.entries if e.num_draft}
        stopped: list[Hashable] = []
        updated: list[tuple[SequenceState, int]] = []
        sampled: dict[Hashable, int | list[int]] = {}
        accepted: dict[Hashable, int] = {}
        self.stage_metrics.extend(out.stages)
        waited = pipeline_wait(out.stages)
        for seq in seqs if waited else ():
            seq.metrics.bubble_time += waited
        for e, seq, scored in zip(plan.entries, seqs, out.prompt_logprobs):
            if scored is not None and seq.finish_reason != "abort":
                seq.add_prompt_logprobs(e.start_pos, scored)
        with nvtx_range("detokenize"):  # appending each token decodes its text and checks the stops
            first = 0
            for seq, count in zip(rows, per_row):
                tokens = out.token_ids[first:first + count]
                logprobs = out.logprobs[first:first + count]
                first += count
                if seq.finish_reason == "abort":  # aborted while this step ran
                    continue
                if seq.index and not seq.output and seq.prompt_logprobs is not None:  # forked: the prompt's scores
                    seq.prompt_logprobs = list(self._requests[seq.request_id][0].prompt_logprobs or ())
                kept = 0
                for token, logprob in zip(tokens, logprobs):  # a verifying row's tokens, one by one
                    seq.append(token, logprob, now)
                    kept += 1
                    if seq.finish_reason is not None:
                        break
                updated.append((seq, kept))
                if seq.key in drafts:
                    seq.metrics.num_draft_tokens += drafts[seq.key]
                    seq.metrics.num_accepted_tokens += count - 1
                    self.num_draft_tokens += drafts[seq.key]
                    self.num_accepted_tokens += count - 1
                    accepted[seq.key] = kept - 1
                    sampled[seq.key] = tokens[:kept]
                else:
                    sampled[seq.key] = tokens[0]
                if seq.finish_reason == "stop":
                    stopped.append(seq.key)
        finished = set(self.scheduler.update(plan, stopped, sampled, accepted))  # sampled: keys generated blocks
        outputs = []
        for seq, kept in updated:
            if seq.key in finished:
                seq.finish_reason = seq.finish_reason or "length"
                seq.metrics.finish_time = now
                del self._seqs[seq.key]
                self.scheduler.release(seq.key)
                if self.proposer is not None:
                    self.proposer.release(seq.key)
                if not any(q.key in self._seqs for q in self._requests[seq.request_id]):
                    del self._requests[seq.request_id]
            outputs.append(seq.to_output(kept))
        predicted = None
        if self.step_time_model is not None:  # predicted before it learns from this step
            predicted = self.step_time_model.predict_shape(StepShape.of_plan(plan))
            self.step_time_model.observe(plan, now - start)
        if self.step_observer is not None:
            self.step_observer(plan, now - start)
        self.step_metrics.append(StepMetrics(start, now - start, plan.num_tokens, plan.num_prefill_tokens,
                                             plan.num_decode_tokens, len(plan.entries), plan.tile_padding,
                                             predicted))
        self.num_steps += 1
        return outputs


def _default_executor(config: EngineConfig, model: ResolvedModel) -> Executor:
    if config.world_size == 1:
        return InProcessExecutor(config, model)
    from .distributed import MultiprocessExecutor, torchrun  # torch.distributed only when asked for

    if torchrun.launched_by_torchrun():  # rank 0 drives; the other ranks serve here, then exit
        return torchrun.start(config, model)
    return MultiprocessExecutor(config, model)
