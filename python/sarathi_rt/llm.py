"""`LLM`: the offline entry point. Give it prompts, get completions (all at once, as a
stream, or as an asyncio stream); everything runs through one LLMEngine."""
from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Union

from tqdm.auto import tqdm

from sarathi_rt.config.speculative import speculative_fields
from sarathi_rt.engine import AsyncLLMEngine, EngineConfig, LLMEngine, RequestOutput
from sarathi_rt.models import resolve_configured, resolve_model_path
from sarathi_rt.sampling import SamplingParams
from sarathi_rt.text.tokenizer import Tokenizer, tokenizer_at

Prompt = Union[str, Sequence[int]]
Conversation = Sequence[Mapping[str, Any]]


class LLM:
    """A model served by a Sarathi-Serve engine. `model` is a Hugging Face directory
    (config.json + safetensors; a tokenizer.json there enables text prompts), a LLaMA
    GGUF file (tokenizer and chat template included), a named model fetched on first use
    ("smollm2-135m-instruct"), or a preset name ("tiny", "cpu-small", "llama3-8b") with
    seeded random weights. The other keyword arguments are EngineConfig's fields (device,
    dtype, policy, token_budget, max_num_seqs, enable_prefix_caching, tbt_slo, ...; an
    unknown one raises TypeError); tensor_parallel_size x pipeline_parallel_size > 1 runs
    the model in that many worker processes. Use it as a context manager, or call
    shutdown(), to stop them. `tokenizer` (a Tokenizer, a GGUF file or a directory with
    tokenizer.json) overrides the model's own; with one, prompts can be text and outputs
    carry text. A HF directory whose architecture has no native family runs through
    transformers (model_impl="transformers" forces that, "native" refuses it), running
    modelling code shipped in the directory only with trust_remote_code=True. Under
    torchrun the job's processes are the workers: the call returns on world rank 0 and,
    on every other rank, serves until rank 0 shuts down, then exits.
    `speculative` ({"method": "ngram", "k": 4, "ngram_min": 2, "ngram_max": 4}) sets the
    speculative_* fields: decodes propose tokens that the next step verifies
    (docs/speculative.md)."""

    def __init__(self, model: str | Path, *, tokenizer: str | Path | Tokenizer | None = None,
                 speculative: Mapping[str, Any] | None = None, **options: Any) -> None:
        if speculative is not None:
            options |= speculative_fields(speculative)
        config = EngineConfig(model=model, **options)
        # A bad model is named before its tokenizer is looked at.
        resolved = resolve_configured(config)
        self.tokenizer = tokenizer if isinstance(tokenizer, Tokenizer) else load_tokenizer(model, tokenizer)
        if tokenizer is not None and self.tokenizer is None:
            raise ValueError(f"tokenizer {str(tokenizer)!r} is neither a GGUF file nor a directory with "
                             "tokenizer.json")
        self.engine = LLMEngine(config, tokenizer=self.tokenizer, model=resolved)
        self._ids = itertools.count()
        self._async: AsyncLLMEngine | None = None
        self._async_loop: asyncio.AbstractEventLoop | None = None

    def shutdown(self) -> None:
        """Stop the engine's worker processes (idempotent)."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ prompts
    def _encode(self, prompt: object, index: int) -> list[int] | Sequence[int]:
        if not isinstance(prompt, str):
            return prompt  # type: ignore[return-value]  (the engine checks token ids)
        if self.tokenizer is None:
            raise ValueError(f"prompts[{index}] is text, but the model has no tokenizer; pass token ids")
        return self.tokenizer.encode(prompt)

    def _requests(self, prompts: Prompt | Sequence[Prompt],
                  params: SamplingParams | Sequence[SamplingParams] | None,
                  qos: str | Sequence[str | None] | None = None) -> list[tuple[Any, SamplingParams | None, str | None]]:
        if isinstance(prompts, str):
            prompts = [prompts]
        if not isinstance(prompts, Sequence) or not prompts:
            raise ValueError("prompts must be a non-empty list of prompts (token-id lists or strings)")
        per_prompt = _one_per_prompt(params, SamplingParams, len(prompts), "params", "one SamplingParams")
        classes = _one_per_prompt(qos, str, len(prompts), "qos", "one class name")
        return [(self._encode(p, i), sp, q) for i, (p, sp, q) in enumerate(zip(prompts, per_prompt, classes))]

    def _add_all(self, prompts: Prompt | Sequence[Prompt],
                 params: SamplingParams | Sequence[SamplingParams] | None,
                 qos: str | Sequence[str | None] | None = None) -> dict[str, int]:
        """Add every prompt or none: a bad one rolls back those added before it. Returns
        the request ids, in prompt order, with their number of samples."""
        ids: dict[str, int] = {}
        for i, (tokens, sp, q) in enumerate(self._requests(prompts, params, qos)):
            request_id = f"llm-{next(self._ids)}"
            try:
                self.engine.add_request(request_id, tokens, sp, qos=q)
            except (ValueError, TypeError) as exc:
                for done in ids:
                    self.engine.abort(done)
                raise type(exc)(f"prompts[{i}]: {exc}") from exc
            ids[request_id] = 1 if sp is None else sp.n
        return ids

    def _chat_prompts(self, conversations: Conversation | Sequence[Conversation]) -> list[list[int]]:
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer with a chat template; this model has none")
        if isinstance(conversations, Sequence) and conversations and isinstance(conversations[0], Mapping):
            conversations = [conversations]  # type: ignore[list-item]  (one conversation)
        if isinstance(conversations, (str, bytes)) or not isinstance(conversations, Sequence) or not conversations:
            raise ValueError("conversations must be a conversation ([{'role': ..., 'content': ...}, ...]) "
                             "or a non-empty list of them")
        prompts = []
        for i, conv in enumerate(conversations):
            try:
                prompts.append(self.tokenizer.apply_chat_template(conv, add_generation_prompt=True))
            except ValueError as exc:
                raise ValueError(f"conversations[{i}]: {exc}") from exc
        return prompts  # type: ignore[return-value]

    # ------------------------------------------------------------------ running
    def generate(self, prompts: Prompt | Sequence[Prompt],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, qos: str | Sequence[str | None] | None = None) -> list[RequestOutput]:
        """Run every prompt to completion; one output per prompt, in prompt order (with
        SamplingParams(n > 1): sample 0's, holding all n in `samples` / `outputs`). The
        progress bar shows on a terminal only. `qos`: the QoS class (one for all, or one
        per prompt) when the LLM was made with qos_classes."""
        ids = self._add_all(prompts, params, qos)
        samples: dict[str, list[RequestOutput | None]] = {request_id: [None] * n for request_id, n in ids.items()}
        with tqdm(total=len(ids), desc="generate", unit="req", disable=None if use_tqdm else True) as bar:
            for out in self._drive(ids):
                if out.finished:
                    done = samples[out.request_id]
                    done[out.index] = out
                    bar.update(all(x is not None for x in done))
        results = []
        for done in samples.values():
            first = done[0]
            assert first is not None
            if len(done) > 1:
                first.samples = tuple(done)  # type: ignore[arg-type]  (all finished)
            results.append(first)
        return results

    def chat(self, conversations: Conversation | Sequence[Conversation],
             params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, qos: str | Sequence[str | None] | None = None) -> list[RequestOutput]:
        """`generate` for conversations ([{"role": "user", "content": ...}, ...], or a
        list of them): each is rendered with the model's chat template, ending with the
        assistant's turn to speak."""
        return self.generate(self._chat_prompts(conversations), params, use_tqdm, qos)

    def stream(self, prompts: Prompt | Sequence[Prompt],
               params: SamplingParams | Sequence[SamplingParams] | None = None,
               qos: str | Sequence[str | None] | None = None) -> Iterator[RequestOutput]:
        """Yield each step's output for each of these prompts (new_token_ids holds the
        step's token, new_text its text); a request's last output has finished=True
        (with n > 1, each sample's, told apart by `index`). Closing the iterator early
        aborts what is still running."""
        yield from self._drive(self._add_all(prompts, params, qos))

    def _drive(self, ids: dict[str, int]) -> Iterator[RequestOutput]:
        """Step until every sample of the requests `ids` (id -> samples) finished."""
        live = dict(ids)
        try:
            while live:
                for out in self.engine.step():
                    if out.request_id in live:
                        if out.finished:
                            _count_down(live, out.request_id)
                        yield out
        finally:  # the consumer stopped early (or a step raised)
            for request_id in live:
                if self.engine.has_request(request_id):
                    self.engine.abort(request_id)

    async def astream(self, prompts: Prompt | Sequence[Prompt],
                      params: SamplingParams | Sequence[SamplingParams] | None = None,
                      qos: str | Sequence[str | None] | None = None) -> AsyncIterator[RequestOutput]:
        """`stream` for asyncio: steps run in a worker thread between yields."""
        aengine = self._async_engine()
        queue: asyncio.Queue[RequestOutput | Exception] = asyncio.Queue()
        live: dict[str, int] = {}  # request id -> samples still running
        try:
            for tokens, sp, q in self._requests(prompts, params, qos):
                request_id = f"llm-{next(self._ids)}"
                await aengine.add_request(request_id, tokens, sp, queue, qos=q)
                live[request_id] = 1 if sp is None else sp.n
            while live:
                out = await queue.get()
                if isinstance(out, Exception):
                    raise out
                if out.finished:
                    _count_down(live, out.request_id)
                yield out
        finally:
            for request_id in live:
                await aengine.abort(request_id)

    def _async_engine(self) -> AsyncLLMEngine:
        loop = asyncio.get_running_loop()
        if self._async is None or self._async_loop is not loop:
            if self._async is not None:  # its loop is gone: so is any use of its step thread
                self._async.close()
            self._async, self._async_loop = AsyncLLMEngine(self.engine), loop
        return self._async


def load_tokenizer(model: str | Path, tokenizer: str | Path | None = None) -> Tokenizer | None:
    """The tokenizer of `model` (its GGUF file's, or its directory's tokenizer.json; None
    for presets), or the one at `tokenizer` if given."""
    return tokenizer_at(resolve_model_path(model) if tokenizer is None else Path(tokenizer))


def _count_down(live: dict[str, int], request_id: str) -> None:
    """One more sample of `request_id` finished; forget the request after its last."""
    live[request_id] -= 1
    if not live[request_id]:
        del live[request_id]


def _one_per_prompt(value: object, single: type, n: int, name: str, what: str) -> Sequence:
    """`value` (None or one `single`) repeated for each of `n` prompts, or a sequence of
    exactly n; ValueError naming `name` otherwise."""
    if value is None or isinstance(value, single):
        return [value] * n
    if isinstance(value, Sequence) and len(value) == n:
        return value
    raise ValueError(f"{name} must be {what} or one per prompt ({n})")
