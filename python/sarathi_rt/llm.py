"""`LLM`: the offline entry point. Give it prompts, get completions (all at once, as a
stream, or as an asyncio stream); everything runs through one LLMEngine."""
from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any, Union

import torch
from tqdm.auto import tqdm

from sarathi_rt.engine import AsyncLLMEngine, EngineConfig, LLMEngine, RequestOutput
from sarathi_rt.sampling import SamplingParams

Prompt = Union[str, Sequence[int]]
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


class LLM:
    """A model served by a Sarathi-Serve engine. `model` is a Hugging Face directory
    (config.json + safetensors; a tokenizer there enables text prompts) or a preset name
    ("tiny", "cpu-small", "llama3-8b") with seeded random weights. The keyword arguments
    are EngineConfig's fields (device, dtype, policy, token_budget, max_num_seqs, ...;
    an unknown one raises TypeError); tensor_parallel_size x pipeline_parallel_size > 1 runs the model
    in that many worker processes. Use it as a context manager, or call shutdown(), to
    stop them. tbt_slo (seconds) sizes every step to that time-between-tokens target
    (the adaptive budget, learned online; token_budget caps it). Under torchrun the
    job's processes are the workers: the call returns on world rank 0 and, on every
    other rank, serves until rank 0 shuts down, then exits."""

    def __init__(self, model: str | Path, **options: Any) -> None:
        config = EngineConfig(model=model, **options)
        self.engine = LLMEngine(config)
        self.tokenizer = _load_tokenizer(Path(model))
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
                  params: SamplingParams | Sequence[SamplingParams] | None) -> list[tuple[Any, SamplingParams | None]]:
        if isinstance(prompts, str):
            prompts = [prompts]
        if not isinstance(prompts, Sequence) or not prompts:
            raise ValueError("prompts must be a non-empty list of prompts (token-id lists or strings)")
        if params is None or isinstance(params, SamplingParams):
            per_prompt: Sequence[SamplingParams | None] = [params] * len(prompts)
        elif isinstance(params, Sequence) and len(params) == len(prompts):
            per_prompt = params
        else:
            raise ValueError(f"params must be one SamplingParams or one per prompt ({len(prompts)})")
        return [(self._encode(p, i), sp) for i, (p, sp) in enumerate(zip(prompts, per_prompt))]

    def _add_all(self, prompts: Prompt | Sequence[Prompt],
                 params: SamplingParams | Sequence[SamplingParams] | None) -> list[str]:
        """Add every prompt or none: a bad one rolls back those added before it."""
        ids: list[str] = []
        for i, (tokens, sp) in enumerate(self._requests(prompts, params)):
            request_id = f"llm-{next(self._ids)}"
            try:
                self.engine.add_request(request_id, tokens, sp)
            except (ValueError, TypeError) as exc:
                for done in ids:
                    self.engine.abort(done)
                raise type(exc)(f"prompts[{i}]: {exc}") from exc
            ids.append(request_id)
        return ids

    def _finish(self, out: RequestOutput) -> RequestOutput:
        if out.finished and self.tokenizer is not None:
            out.text = self.tokenizer.decode(list(out.token_ids), skip_special_tokens=True)
        return out

    # ------------------------------------------------------------------ running
    def generate(self, prompts: Prompt | Sequence[Prompt],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Run every prompt to completion; outputs in prompt order. The progress bar
        shows on a terminal only."""
        ids = self._add_all(prompts, params)
        order = {request_id: i for i, request_id in enumerate(ids)}
        results: list[RequestOutput | None] = [None] * len(ids)
        with tqdm(total=len(ids), desc="generate", unit="req", disable=None if use_tqdm else True) as bar:
            for out in self._drive(set(ids)):
                if out.finished:
                    results[order[out.request_id]] = self._finish(out)
                    bar.update(1)
        return results  # type: ignore[return-value]

    def stream(self, prompts: Prompt | Sequence[Prompt],
               params: SamplingParams | Sequence[SamplingParams] | None = None) -> Iterator[RequestOutput]:
        """Yield each step's output for each of these prompts (new_token_ids holds the
        step's token); a request's last output has finished=True. Closing the iterator
        early aborts what is still running."""
        ids = set(self._add_all(prompts, params))
        yield from (self._finish(out) for out in self._drive(ids))

    def _drive(self, ids: set[str]) -> Iterator[RequestOutput]:
        live = set(ids)
        try:
            while live:
                for out in self.engine.step():
                    if out.request_id in live:
                        if out.finished:
                            live.discard(out.request_id)
                        yield out
        finally:  # the consumer stopped early (or a step raised)
            for request_id in live:
                if self.engine.has_request(request_id):
                    self.engine.abort(request_id)

    async def astream(self, prompts: Prompt | Sequence[Prompt],
                      params: SamplingParams | Sequence[SamplingParams] | None = None
                      ) -> AsyncIterator[RequestOutput]:
        """`stream` for asyncio: steps run in a worker thread between yields."""
        aengine = self._async_engine()
        queue: asyncio.Queue[RequestOutput | Exception] = asyncio.Queue()
        live: set[str] = set()
        try:
            for tokens, sp in self._requests(prompts, params):
                request_id = f"llm-{next(self._ids)}"
                await aengine.add_request(request_id, tokens, sp, queue)
                live.add(request_id)
            while live:
                out = await queue.get()
                if isinstance(out, Exception):
                    raise out
                if out.finished:
                    live.discard(out.request_id)
                yield self._finish(out)
        finally:
            for request_id in live:
                await aengine.abort(request_id)

    def _async_engine(self) -> AsyncLLMEngine:
        loop = asyncio.get_running_loop()
        if self._async is None or self._async_loop is not loop:
            self._async, self._async_loop = AsyncLLMEngine(self.engine), loop
        return self._async


def _load_tokenizer(path: Path) -> Any:
    if not path.is_dir() or not any((path / f).is_file() for f in _TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer  # optional: only for models that ship a tokenizer

    return AutoTokenizer.from_pretrained(str(path))
