"""The speculative-decoding section of the config tree: which proposer guesses a
decode's next tokens, and how many it may guess. The engine verifies the guesses in
the hybrid batch (docs/speculative.md)."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sarathi_rt.scheduler.registry import get_policy
from sarathi_rt.utils.checks import positive_int
from sarathi_rt.utils.options import option

SPECULATIVE_METHODS = ("none", "ngram", "draft")
# Each draft token takes one row of the step's token budget and one of the step's time,
# and a run of k proposals is kept whole only with probability acceptance**k: past 16,
# a guess is worth less than the prefill tokens its row could have carried.
MAX_SPECULATIVE_K = 16
# Longest n-gram matched: a longer suffix of a request rarely repeats where a shorter
# one does not, and every extra length is one more index entry per token.
MAX_NGRAM = 16


@dataclass(frozen=True, kw_only=True)
class SpeculativeOptions:
    """Speculative decoding: proposed tokens verified in the hybrid batch."""

    SECTION = "speculative decoding"

    speculative_method: str = option("none", "none; ngram: propose what followed the latest earlier "
                                             "occurrence of the request's last n tokens (prompt lookup); draft: "
                                             "propose speculative_model's greedy continuation",
                                     choices=SPECULATIVE_METHODS)
    speculative_model: str | Path | None = option(None, "the draft model of speculative_method draft, named as "
                                                        "model is (a named model, a GGUF file, a Hugging Face "
                                                        "directory or a preset); same vocabulary and tokenizer "
                                                        "as model, and no larger")
    speculative_k: int = option(4, f"most tokens proposed per decode per step (1..{MAX_SPECULATIVE_K}); the "
                                   "scheduler verifies fewer when the budget or the acceptance rate says so")
    speculative_ngram_min: int = option(2, "shortest suffix the n-gram proposer matches")
    speculative_ngram_max: int = option(4, f"longest suffix the n-gram proposer matches (tried first; at most "
                                           f"{MAX_NGRAM})")

    @property
    def speculating(self) -> bool:
        return self.speculative_method != "none"

    def _check_speculative(self, policy: str, world_size: int) -> None:
        if self.speculative_method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_method must be one of {list(SPECULATIVE_METHODS)}, "
                             f"got {self.speculative_method!r}")
        positive_int("speculative_k", self.speculative_k)
        if self.speculative_k > MAX_SPECULATIVE_K:
            raise ValueError(f"speculative_k must be at most {MAX_SPECULATIVE_K}, got {self.speculative_k}")
        if self.speculative_method == "draft":
            if self.speculative_model is None:
                raise ValueError("speculative_method 'draft' needs speculative_model (the draft model)")
            if not isinstance(self.speculative_model, (str, Path)) or not str(self.speculative_model):
                raise ValueError(f"speculative_model must be a directory path, a GGUF file, a named model or a "
                                 f"preset, got {self.speculative_model!r}")
            if world_size > 1:
                # The draft runs in the driver's process, beside no worker of the target's.
                raise ValueError(f"speculative_method 'draft' runs on one worker; tensor_parallel_size x "
                                 f"pipeline_parallel_size is {world_size}")
        elif self.speculative_model is not None:
            raise ValueError(f"speculative_model is set ({str(self.speculative_model)!r}) but speculative_method "
                             f"is {self.speculative_method!r}; a draft model runs with speculative_method 'draft'")
        positive_int("speculative_ngram_min", self.speculative_ngram_min)
        positive_int("speculative_ngram_max", self.speculative_ngram_max)
        if not self.speculative_ngram_min <= self.speculative_ngram_max <= MAX_NGRAM:
            raise ValueError(f"speculative_ngram_min ({self.speculative_ngram_min}) <= speculative_ngram_max "
                             f"({self.speculative_ngram_max}) <= {MAX_NGRAM} must hold")
        if self.speculating and not get_policy(policy).chunked:
            # Draft rows share the step's token budget with prefill chunks; an unchunked
            # policy must run a whole prompt in one step, so a step with draft rows could
            # leave no room for the prompt at the head of the queue.
            raise ValueError(f"speculative_method {self.speculative_method!r} needs a chunking policy (sarathi, "
                             f"decode_maximal): policy {policy!r} prefills whole prompts, which draft rows "
                             "in the token budget could keep from ever fitting a step")


def speculative_fields(speculative: Mapping[str, Any]) -> dict[str, Any]:
    """LLM(speculative={"method": "ngram", "k": 4, "ngram_min": 2, "ngram_max": 4}) or
    LLM(speculative={"method": "draft", "model": "tiny", "k": 4}) as config fields."""
    if not isinstance(speculative, Mapping):
        raise TypeError(f"speculative must be a mapping such as {{'method': 'ngram', 'k': 4}}, "
                        f"got {type(speculative).__name__}")
    known = {"method", "k", "model", "ngram_min", "ngram_max"}
    unknown = sorted(set(speculative) - known)
    if unknown:
        raise ValueError(f"speculative has unknown keys {unknown}; known: {sorted(known)}")
    return {f"speculative_{key}": value for key, value in speculative.items()}
