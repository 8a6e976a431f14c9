"""Speculative decoding with a draft model: tiny (2 layers, random weights) drafting for
tiny-deep (8 layers, the same vocabulary). Greedy outputs are token for token those of
plain decoding (several prompts, prefix caching, n > 1, max_tokens, abort mid-speculation,
a cache small enough to preempt); the target's and the draft's blocks are all free after
every run; the target drafting for itself accepts nearly everything (the draft path
proposes the right tokens at the right positions); each bad setting is named."""
from __future__ import annotations

import random
from collections import Counter
from types import SimpleNamespace

import pytest

from spec_sampling import same_distribution_pvalue, verify_every_proposal
from sarathi_rt import LLM, SamplingParams
from sarathi_rt.config import EngineConfig
from sarathi_rt.engine.draft import DraftProposer, check_draft
from sarathi_rt.models import resolve_model

TARGET, DRAFT = "tiny-deep", "tiny"
BLOCK = 8
RNG = random.Random(11)
PROMPTS = [[RNG.randrange(3, 500) for _ in range(n)] for n in (5, 23, 40, 9)]
GREEDY = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.0)


def _llm(draft: str | None = DRAFT, k: int = 3, **options: object) -> LLM:
    speculative = None if draft is None else {"method": "draft", "model": draft, "k": k}
    return LLM(TARGET, **{"num_kv_blocks": 64, "block_size": BLOCK, "enable_prefix_caching": False, **options},
               speculative=speculative)


def _ids(outs: list) -> list[list[list[int]]]:
    return [[list(s.token_ids) for s in o.outputs] for o in outs]


def _draft(llm: LLM) -> DraftProposer:
    proposer = llm.engine.proposer
    assert isinstance(proposer, DraftProposer)
    return proposer


def _all_free(llm: LLM) -> bool:
    draft = _draft(llm)
    return llm.engine.scheduler.num_free_blocks == llm.engine.scheduler_config.num_blocks \
        and draft.num_free_blocks == draft.num_blocks


@pytest.fixture(scope="module")
def plain() -> list[list[list[int]]]:
    return _ids(_llm(None).generate(PROMPTS, GREEDY, use_tqdm=False))


@pytest.mark.parametrize("options", [
    {}, {"enable_prefix_caching": True}, {"token_budget": 16, "chunk_size": 8},
    {"num_kv_blocks": 12},  # preemptions by recompute; the draft's cache is as small
], ids=["sarathi", "prefix_cache", "small_budget", "preemption"])
def test_greedy_outputs_equal_plain_decoding(plain: list[list[list[int]]], options: dict) -> None:
    llm = _llm(**options)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert _ids(outs) == plain
    assert sum(o.num_draft_tokens for o in outs) > 0
    assert _all_free(llm)
    assert not _draft(llm)._seqs  # every sample released
    if "num_kv_blocks" in options:
        assert llm.engine.num_preemptions > 0


def test_n_samples_and_max_tokens(plain: list[list[list[int]]]) -> None:
    params = [SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.0, n=2),
              SamplingParams(max_tokens=7, ignore_eos=True, temperature=0.0),
              GREEDY, SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0)]
    llm = _llm(k=4)
    got = _ids(llm.generate(PROMPTS, params, use_tqdm=False))
    assert got[0] == plain[0] * 2  # greedy samples agree
    assert got[1] == [plain[1][0][:7]]
    assert got[2] == plain[2]
    assert got[3] == [plain[3][0][:1]]
    assert _all_free(llm)


def test_abort_mid_speculation_frees_every_block(plain: list[list[list[int]]]) -> None:
    llm = _llm()
    engine = llm.engine
    for i, prompt in enumerate(PROMPTS[:2]):
        engine.add_request(f"r{i}", prompt, GREEDY)
    while engine._seqs["r0"].metrics.num_draft_tokens == 0:
        engine.step()
    assert _draft(llm).num_free_blocks < _draft(llm).num_blocks  # the draft holds r0 and r1
    engine.abort("r0")
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert {o.request_id: o.finish_reason for o in outs if o.finished} == {"r0": "abort", "r1": "length"}
    assert [list(o.token_ids) for o in outs if o.request_id == "r1" and o.finished] == plain[1]
    assert _all_free(llm)


def test_the_target_as_its_own_draft_accepts_nearly_everything(plain: list[list[list[int]]]) -> None:
    """Same preset, same seed: the same weights, so every greedy proposal is the target's
    own token (up to float ties) and only the budget or max_tokens cut a run short."""
    llm = _llm(TARGET, k=4)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert _ids(outs) == plain
    drafted = sum(o.num_draft_tokens for o in outs)
    accepted = sum(o.num_accepted_tokens for o in outs)
    assert drafted > 0 and accepted / drafted > 0.9, (accepted, drafted)
    assert _all_free(llm)
    base = _llm(None)
    base.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert llm.engine.num_steps < base.engine.num_steps / 2  # up to 5 tokens a step where plain makes 1


def test_rejection_sampling_of_draft_proposals_keeps_the_target_distribution(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """tiny drafting for itself (its greedy guess, accepted with the probability the
    target gives it: about a fifth of the time for a random model at top_k 4) against
    plain sampling: tokens 2, 3 and 4 of 400 seeded samples each, a two-sample
    chi-square test per position at significance 0.001, every proposal verified. Under
    the null hypothesis the three tests fail together with probability at most 0.003 (a
    union bound); the seeds are fixed, so the test is deterministic and that is the
    chance that a change which keeps the distribution (and so moves the random streams)
    trips it."""
    verify_every_proposal(monkeypatch)
    params = [SamplingParams(max_tokens=4, ignore_eos=True, temperature=1.0, top_k=4, seed=s) for s in range(400)]
    prompts = [PROMPTS[1]] * len(params)
    options = {"num_kv_blocks": 64, "block_size": BLOCK, "enable_prefix_caching": False, "max_num_seqs": 32}
    plain_outs = LLM(DRAFT, **options).generate(prompts, params, use_tqdm=False)
    llm = LLM(DRAFT, speculative={"method": "draft", "model": DRAFT, "k": 3}, **options)
    spec_outs = llm.generate(prompts, params, use_tqdm=False)
    drafted, accepted = sum(o.num_draft_tokens for o in spec_outs), sum(o.num_accepted_tokens for o in spec_outs)
    assert 0.1 * drafted < accepted < 0.9 * drafted, (accepted, drafted)  # both branches, many times
    for position in (1, 2, 3):
        a = Counter(o.token_ids[position] for o in plain_outs)
        b = Counter(o.token_ids[position] for o in spec_outs)
        assert same_distribution_pvalue(a, b) > 0.001, (position, a, b)
    assert _all_free(llm)


def test_draft_cache_mirrors_the_targets_blocks() -> None:
    llm = _llm(num_kv_blocks=40)
    assert _draft(llm).num_blocks == 40 == llm.engine.scheduler_config.num_blocks


# -------------------------------------------------------------------------- errors
@pytest.mark.parametrize("options, message", [
    ({"speculative_method": "draft"}, r"speculative_method 'draft' needs speculative_model"),
    ({"speculative_method": "ngram", "speculative_model": DRAFT}, r"speculative_model is set \('tiny'\) but "),
    ({"speculative_method": "draft", "speculative_model": ""}, "speculative_model must be a directory path"),
    ({"speculative_method": "draft", "speculative_model": DRAFT, "pipeline_parallel_size": 2},
     r"speculative_method 'draft' runs on one worker"),
])
def test_bad_draft_settings_are_named_by_the_config(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(model=TARGET, **options)


@pytest.mark.parametrize("target, draft, message", [
    (TARGET, "cpu-small", r"speculative_model 'cpu-small' has vocab_size 32000, the target 'tiny-deep' 512"),
    (DRAFT, TARGET, r"speculative_model 'tiny-deep' is larger than the target 'tiny': 8 layers x hidden 64"),
    (TARGET, "no-such-model", r"speculative_model: model must be"),
])
def test_bad_draft_models_are_named_before_weights_load(target: str, draft: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LLM(target, num_kv_blocks=16, speculative={"method": "draft", "model": draft})


def test_a_draft_with_another_tokenizer_is_named() -> None:
    target, draft = resolve_model(TARGET), resolve_model(DRAFT)
    ours = SimpleNamespace(vocab_size=512, bos_token_id=1, eos_token_ids=(2,))
    check_draft(target, draft, ours, SimpleNamespace(**vars(ours)))  # the same tokenizer passes
    check_draft(target, draft, ours, None)  # a preset has none: nothing to compare
    for name, value in (("vocab_size", 500), ("bos_token_id", 0), ("eos_token_ids", (2, 3))):
        other = SimpleNamespace(**vars(ours) | {name: value})
        with pytest.raises(ValueError, match=f"another tokenizer than the target 'tiny-deep': its {name}"):
            check_draft(target, draft, ours, other)


def test_serve_flags_reach_the_draft_fields() -> None:
    import argparse

    from sarathi_rt.commands import serve
    from sarathi_rt.config.flags import engine_config

    parser = argparse.ArgumentParser()
    serve.add_parser(parser.add_subparsers())
    args = parser.parse_args(["serve", "--model", TARGET, "--speculative-method", "draft",
                              "--speculative-model", DRAFT, "--speculative-k", "2"])
    config = engine_config(args)
    assert (config.speculative_method, config.speculative_model, config.speculative_k) == ("draft", DRAFT, 2)
