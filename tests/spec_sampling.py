"""Helpers of the tests that speculative sampling keeps the target's distribution: a
scheduler that verifies every proposal, and a two-sample chi-square test of token counts."""
from __future__ import annotations

from collections import Counter

import pytest

# Tokens drawn fewer times than this (both samples together) are pooled into one cell,
# so that every expected count is large enough for the chi-square approximation.
MIN_CELL = 20


def verify_every_proposal(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ask every decode for proposals and verify all that the budget holds: with the
    many decodes a step these tests run, the scheduler's rule would rightly fade
    speculation out (tests/test_speculation_rule.py), and these tests are about the
    sampler, not the rule."""
    from sarathi_rt.scheduler import drafting

    def every_proposal(candidates: list, budget_left: int, **_: object) -> list[int]:
        lengths = []
        for c in candidates:
            lengths.append(min(c.available, budget_left))
            budget_left -= lengths[-1]
        return lengths

    monkeypatch.setattr(drafting, "speculation_lengths", every_proposal)
    monkeypatch.setattr(drafting, "draft_floor", lambda *_, **__: 0.0)


def same_distribution_pvalue(a: Counter, b: Counter) -> float:
    """The p-value of a two-sample chi-square test that the counts `a` and `b` come from
    one distribution (the rare tokens pooled, see MIN_CELL)."""
    from scipy.stats import chi2_contingency

    tokens = sorted(set(a) | set(b))
    common = [t for t in tokens if a[t] + b[t] >= MIN_CELL]
    table = [[a[t] for t in common] + [sum(a[t] for t in tokens if t not in common)],
             [b[t] for t in common] + [sum(b[t] for t in tokens if t not in common)]]
    if table[0][-1] + table[1][-1] == 0:
        table = [row[:-1] for row in table]
    return float(chi2_contingency(table).pvalue)
