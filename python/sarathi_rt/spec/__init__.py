"""Proposers for speculative decoding: cheap guesses at a decode's next tokens, which
the engine verifies in the hybrid batch (docs/speculative.md). Torch-free."""
from .ngram import NgramProposer
from .proposer import Proposer, ProposalSource, create_proposer

__all__ = ["NgramProposer", "ProposalSource", "Proposer", "create_proposer"]
