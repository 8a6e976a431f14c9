"""Greedy runs that keep every step's logits, shared by the tests that hold another
forward (compiled, the layer loop) against the eager layers."""
from __future__ import annotations

import torch

from sarathi_rt import LLM, SamplingParams


def run_recording(llm: LLM, prompts: list[list[int]], params: SamplingParams
                  ) -> tuple[list[list[int]], list[torch.Tensor], list[tuple[int, int]]]:
    """Tokens per prompt, each step's logits, and each step's (tokens, requests)."""
    worker = llm.engine.executor.worker
    logits: list[torch.Tensor] = []
    steps: list[tuple[int, int]] = []
    compute_logits = worker.model.compute_logits

    def recording(hidden: torch.Tensor, residual: torch.Tensor | None, ctx) -> torch.Tensor | None:
        steps.append((ctx.num_tokens, ctx.seqlens_k.shape[0]))
        out = compute_logits(hidden, residual, ctx)
        logits.append(out.clone())
        return out

    worker.model.compute_logits = recording
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [o.token_ids for o in outs], logits, steps
