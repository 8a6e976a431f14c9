"""Proposers for speculative decoding: cheap guesses at a decode's next tokens, which
the engine verifies in the hybrid batch (docs/speculative.md). Torch-free."""
from .ngram import NgramProposer
from .proposer import ProposalSource, Proposer

__all__ = ["NgramProposer", "ProposalSource", "Proposer", "create_proposer"]


def create_proposer(method: str, k: int, ngram_min: int, ngram_max: int) -> Proposer | None:
    """The torch-free proposer of config.speculative_method (None for "none"); "draft"
    runs a model, so the engine builds it (engine.draft.DraftProposer)."""
    if method == "none":
        return None
    if method == "ngram":
        return NgramProposer(k, ngram_min, ngram_max)
    raise ValueError(f"speculative_method must be 'none' or 'ngram', got {method!r}")
