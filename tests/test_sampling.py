"""SamplingParams validation and the Sampler: greedy, temperature, top-k, top-p, seeds."""
from __future__ import annotations

import math

import pytest
import torch

from sarathi_rt import SamplingParams
from sarathi_rt.engine import RowSampling, Sampler
from sarathi_rt.engine.sampler import row_seed


@pytest.mark.parametrize("field, value", [
    ("max_tokens", 0), ("max_tokens", -3), ("max_tokens", 2.5), ("max_tokens", True),
    ("temperature", -0.1), ("temperature", math.nan), ("temperature", math.inf), ("temperature", "1"),
    ("top_k", 0), ("top_k", -1), ("top_k", 1.5),
    ("top_p", 0.0), ("top_p", 1.01), ("top_p", -0.5), ("top_p", None),
    ("seed", -1), ("seed", 0.5), ("seed", 2**64), ("stop_token_ids", "12"), ("stop_token_ids", [1, -2]),
    ("stop_token_ids", [1.0]), ("stop_token_ids", 7), ("ignore_eos", "yes"), ("logprobs", True),
    ("logprobs", 21), ("logprobs", -1), ("prompt_logprobs", 21), ("prompt_logprobs", 2.0),
])
def test_invalid_params_name_the_field(field: str, value: object) -> None:
    with pytest.raises((ValueError, TypeError), match=field):
        SamplingParams(**{field: value})


def test_integer_scalars_are_ints() -> None:
    np = pytest.importorskip("numpy")
    p = SamplingParams(max_tokens=np.int64(4), seed=np.uint64(2**64 - 1), stop_token_ids=np.array([3, 4]))
    assert p.max_tokens == 4 and type(p.max_tokens) is int
    assert p.seed == 2**64 - 1 and p.stop_token_ids == (3, 4)
    assert row_seed(2**64 - 1, 0) != row_seed(0, 0)


def test_params_normalise_stop_ids() -> None:
    p = SamplingParams(stop_token_ids=[5, 9], temperature=0)
    assert p.stop_token_ids == (5, 9) and p.greedy and not SamplingParams().greedy


def row(temperature: float = 1.0, top_k: int | None = None, top_p: float = 1.0, seed: int = 7, n: int = 0,
        logprobs: int | None = None) -> RowSampling:
    return RowSampling(temperature, top_k, top_p, seed, n, logprobs)


def test_greedy_takes_the_first_maximum() -> None:
    logits = torch.tensor([[0.0, 3.0, 3.0, 1.0], [5.0, -1.0, 2.0, 5.0]])
    tokens, logprobs = Sampler()(logits, [row(0.0), row(0.0)])
    assert tokens == [1, 0] and logprobs == [None, None]


@pytest.mark.parametrize("settings", [dict(top_k=1), dict(top_p=1e-6), dict(temperature=1e-4)])
def test_degenerate_filters_are_greedy(settings: dict) -> None:
    logits = torch.randn(16, 50, generator=torch.Generator().manual_seed(0))
    tokens, _ = Sampler()(logits, [row(n=i, **settings) for i in range(16)])
    assert tokens == logits.argmax(dim=1).tolist()


def test_same_seed_same_tokens_whatever_the_batch() -> None:
    gen = torch.Generator().manual_seed(1)
    target = torch.randn(1, 1000, generator=gen)
    settings = dict(temperature=0.9, top_k=200, top_p=0.95, seed=1234)
    alone = [Sampler()(target, [row(n=n, **settings)])[0][0] for n in range(20)]
    in_batch = []
    for n in range(20):
        before = n % 3  # neighbours ahead of the target row
        others = torch.randn(n % 5 + 3, 1000, generator=gen)
        logits = torch.cat([others[:before], target, others[before:]])
        rows = [row(0.0 if i % 2 else 1.3, seed=i) for i in range(before)] + [row(n=n, **settings)] + \
               [row(0.7, top_k=5, seed=99 + i) for i in range(logits.shape[0] - before - 1)]
        in_batch.append(Sampler()(logits, rows)[0][before])
    assert in_batch == alone
    assert len(set(alone)) > 5  # really sampling, not stuck on one token
    other_seed = [Sampler()(target, [row(n=n, **{**settings, "seed": 4321})])[0][0] for n in range(20)]
    assert other_seed != alone


def test_frequencies_follow_the_filtered_distribution() -> None:
    # probabilities 0.5, 0.3, 0.15, 0.05 (and two impossible tokens)
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05, 0.0, 0.0]])).expand(4000, 6).contiguous()
    sampler = Sampler()
    for settings, probs in [(dict(), [0.5, 0.3, 0.15, 0.05]),
                            (dict(top_k=2), [0.625, 0.375, 0, 0]),
                            (dict(top_p=0.7), [0.625, 0.375, 0, 0]),
                            (dict(temperature=2.0), None)]:
        tokens, _ = sampler(logits, [row(n=i, **settings) for i in range(4000)])
        counts = torch.bincount(torch.tensor(tokens), minlength=6).double() / 4000
        if probs is None:  # temperature 2 flattens: p_i proportional to sqrt(p_i)
            base = torch.tensor([0.5, 0.3, 0.15, 0.05]).sqrt()
            probs = (base / base.sum()).tolist()
        expected = torch.tensor(probs + [0.0, 0.0], dtype=torch.float64)
        # 4.5 standard deviations of a binomial proportion over 4000 draws
        tolerance = 4.5 * (expected * (1 - expected) / 4000).sqrt() + 1e-12
        assert ((counts - expected).abs() <= tolerance).all(), (settings, counts.tolist())


def test_logprobs_are_of_the_unmodified_distribution() -> None:
    # Raw logits (vLLM's default "raw_logprobs"): temperature and top-k do not change them.
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(3))
    rows = [row(0.0, logprobs=0), row(0.5, top_k=3, logprobs=5), row(1.0)]
    tokens, logprobs = Sampler()(logits, rows)
    ref = logits.double().log_softmax(dim=1)
    assert logprobs[0] is not None and logprobs[1] is not None and logprobs[2] is None
    assert logprobs[0].logprob == pytest.approx(ref[0, tokens[0]].item(), abs=1e-6) and logprobs[0].top == ()
    assert logprobs[1].logprob == pytest.approx(ref[1, tokens[1]].item(), abs=1e-6)
    best = ref[1].topk(5)
    assert [t for t, _ in logprobs[1].top] == best.indices.tolist()
    assert [v for _, v in logprobs[1].top] == pytest.approx(best.values.tolist(), abs=1e-6)


def test_row_seeds_differ_per_token_and_seed() -> None:
    seeds = {row_seed(s, n) for s in range(50) for n in range(50)}
    assert len(seeds) == 2500 and all(0 <= s < 2**63 for s in seeds)


def test_sampler_rejects_mismatched_rows() -> None:
    with pytest.raises(ValueError, match="rows"):
        Sampler()(torch.zeros(2, 5), [row()])
