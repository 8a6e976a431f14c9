"""Speculative decoding, the engine side: the config section and its errors, the n-gram
proposer against a brute-force search, the scheduler's verifying entries (budget, blocks
rolled back, max_new_tokens), and the engine's outputs: greedy token for token the same
as without speculation (every chunking policy, prefix caching, n > 1, logprobs, stop
tokens, max_tokens, preemption, abort mid-step) with the real n-gram proposer and with an
oracle proposer whose guesses are the true continuation with planted errors (so that
runs of accepted, rejected and partly accepted proposals all occur); sampling keeps the
target's distribution (chi-square against plain sampling over many seeds); every KV
block is free again after each run."""
from __future__ import annotations

import abc
import random
from collections import Counter
from typing import Hashable

import pytest

from spec_sampling import same_distribution_pvalue, verify_every_proposal
from sarathi_rt import LLM, SamplingParams
from sarathi_rt.config import EngineConfig
from sarathi_rt.config.speculative import MAX_SPECULATIVE_K
from sarathi_rt.scheduler import SchedulerConfig, create_scheduler
from sarathi_rt.spec import NgramProposer, ProposalSource

BLOCK = 8
NGRAM = {"method": "ngram", "k": 4, "ngram_min": 1, "ngram_max": 3}
RNG = random.Random(7)
# Prompts that repeat themselves, so that the n-gram proposer finds matches at once.
PROMPTS = [[RNG.randrange(3, 60) for _ in range(6)] * 3 + [RNG.randrange(3, 60) for _ in range(5)]
           for _ in range(4)]


def _llm(speculative: dict | None = None, **options: object) -> LLM:
    return LLM("tiny", **{"num_kv_blocks": 96, "block_size": BLOCK, "enable_prefix_caching": False, **options},
               speculative=speculative)


def _all_free(llm: LLM) -> bool:
    return llm.engine.scheduler.num_free_blocks == llm.engine.scheduler_config.num_blocks


class _Seq:
    def __init__(self, key: Hashable, prompt: list[int], output: list[int]) -> None:
        self.key, self.prompt, self.output = key, prompt, output


class _OneByOne(abc.ABC):
    """propose_batch as the engine calls it, one `propose` per sample."""

    @abc.abstractmethod
    def propose(self, seq: ProposalSource) -> list[int]: ...

    def propose_batch(self, seqs: list[ProposalSource], rooms: list[int]) -> list[list[int]]:
        return [self.propose(seq)[:room] if room > 0 else [] for seq, room in zip(seqs, rooms)]


class OracleProposer(_OneByOne):
    """Proposes the true greedy continuation (`truth`, by request id) with every
    `every`-th proposal position replaced by a wrong token, so verification accepts
    whole runs, parts of runs and nothing, in every mix."""

    def __init__(self, truth: dict[Hashable, list[int]], k: int = 4, every: int = 3) -> None:
        self.truth, self.k, self.every = truth, k, every
        self.released: list[Hashable] = []

    def propose(self, seq: ProposalSource) -> list[int]:
        request_id = getattr(seq.key, "request_id", seq.key)
        done = len(seq.output)
        out = self.truth[request_id][done:done + self.k]
        return [t if (done + i) % self.every else (t + 1) % 500 for i, t in enumerate(out)]

    def release(self, key: Hashable) -> None:
        self.released.append(key)


def _ids(outs: list) -> list[list[int]]:
    return [list(o.token_ids) for o in outs]


def _run(llm: LLM, params: SamplingParams, prompts: list[list[int]] = PROMPTS) -> list:
    return llm.generate(prompts, params, use_tqdm=False)


# ------------------------------------------------------------------------- config
@pytest.mark.parametrize("options, message", [
    ({"speculative_method": "ngram", "speculative_k": 0}, "speculative_k must be a positive int, got 0"),
    ({"speculative_method": "ngram", "speculative_k": MAX_SPECULATIVE_K + 1},
     f"speculative_k must be at most {MAX_SPECULATIVE_K}"),
    ({"speculative_method": "medusa"}, r"speculative_method must be one of \['none', 'ngram', 'draft'\]"),
    ({"speculative_method": "ngram", "speculative_ngram_min": 3, "speculative_ngram_max": 2},
     r"speculative_ngram_min \(3\) <= speculative_ngram_max \(2\)"),
    ({"speculative_method": "ngram", "policy": "vllm"}, "policy 'vllm' prefills whole prompts"),
    ({"speculative_method": "ngram", "policy": "orca"}, "policy 'orca' prefills whole prompts"),
])
def test_bad_speculative_settings_are_named(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(model="tiny", **options)


def test_llm_keyword_and_flags_reach_the_same_fields() -> None:
    from sarathi_rt.config.flags import engine_config
    from sarathi_rt.commands import serve
    import argparse

    parser = argparse.ArgumentParser()
    serve.add_parser(parser.add_subparsers())
    args = parser.parse_args(["serve", "--model", "tiny", "--speculative-method", "ngram", "--speculative-k", "3"])
    config = engine_config(args)
    assert (config.speculative_method, config.speculative_k) == ("ngram", 3)
    with _llm({"method": "ngram", "k": 3}) as llm:
        assert (llm.engine.config.speculative_method, llm.engine.config.speculative_k) == ("ngram", 3)
        assert llm.engine.proposer is not None and llm.engine.proposer.k == 3
    with pytest.raises(ValueError, match=r"speculative has unknown keys \['kk'\]"):
        _llm({"method": "ngram", "kk": 3})


# ------------------------------------------------------------------------ proposer
def _brute_force(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    for n in range(n_max, n_min - 1, -1):
        if len(tokens) < n + 1:
            continue
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):  # latest earlier occurrence first
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


def test_ngram_proposer_matches_brute_force_as_the_output_grows() -> None:
    rng = random.Random(3)
    for trial in range(30):
        k, n_min = rng.randint(1, 5), rng.randint(1, 3)
        n_max = rng.randint(n_min, 4)
        proposer = NgramProposer(k, n_min, n_max)
        prompt = [rng.randrange(6) for _ in range(rng.randint(1, 20))]
        seq = _Seq(trial, prompt, [])
        for _ in range(40):
            assert proposer.propose(seq) == _brute_force(prompt + seq.output, k, n_min, n_max)
            seq.output.append(rng.randrange(6))
        proposer.release(trial)
        assert proposer.propose(_Seq(trial, [1], [])) == []  # forgotten: a fresh index


# ----------------------------------------------------------------------- scheduler
def _decoding(scheduler, request_id: str, prompt: int = 5, max_new: int = 20) -> None:
    scheduler.add_request(request_id, prompt, max_new)
    plan = scheduler.schedule()
    scheduler.update(plan)


def test_scheduler_verifies_rolls_back_and_caps_at_max_new_tokens() -> None:
    config = SchedulerConfig(num_blocks=16, block_size=4, token_budget=64, watermark=0.0)
    s = create_scheduler(config)
    _decoding(s, "a", prompt=7, max_new=4)  # KV of positions 0..6 in blocks 0, 1
    free = s.num_free_blocks
    s.set_proposals("a", 8)
    plan = s.schedule()
    (entry,) = plan.entries
    assert entry.num_draft == 2 and entry.num_tokens == 3  # 1 of 4 generated: 1 + 2 more at most
    assert plan.num_decode_tokens == 3
    assert s.num_free_blocks == free - 1  # positions 7..9 reach block 2
    with pytest.raises(ValueError, match=r"accepted\['a'\] must be an int in \[0, 2\]"):
        s.update(plan, accepted={"a": 3})
    with pytest.raises(ValueError, match=r"token_ids\['a'\] holds 1 tokens; the request generated 2"):
        s.update(plan, token_ids={"a": 9}, accepted={"a": 1})
    s.update(plan, accepted={"a": 0})  # only the target's token: computed 8, block 2 rolled back
    info = s.request_info("a")
    assert (info.num_computed, info.num_generated, info.num_blocks) == (8, 2, 2)
    assert s.num_free_blocks == free
    plan = s.schedule()  # no proposals set since: a plain decode
    assert plan.entries[0].num_draft == 0 and plan.entries[0].num_tokens == 1
    s.update(plan)
    s.set_proposals("a", 3)
    plan = s.schedule()
    assert plan.entries[0].num_draft == 0  # 3 of 4 generated: the target's own token is the last
    assert s.update(plan) == ["a"]
    assert s.num_free_blocks == config.num_blocks


def test_scheduler_drafts_take_budget_after_every_decode() -> None:
    config = SchedulerConfig(num_blocks=64, block_size=4, token_budget=6, max_num_seqs=4, watermark=0.0)
    s = create_scheduler(config)
    for r in "abcd":
        s.add_request(r, 3, 30)
    while s.num_waiting or any(s.request_info(r).num_generated == 0 for r in "abcd"):
        s.update(s.schedule())
    for r in "abcd":
        s.set_proposals(r, 4)
    plan = s.schedule()
    assert len(plan.entries) == 4 and plan.num_tokens <= 6
    assert sum(e.num_draft for e in plan.entries) == 2
    with pytest.raises(ValueError, match="accepted names 'zz'"):
        s.update(plan, accepted={"zz": 0})
    s.update(plan)
    with pytest.raises(ValueError, match="n must be an int >= 0, got -1"):
        s.set_proposals("a", -1)
    with pytest.raises(ValueError, match="request_id 'zz' is not scheduled"):
        s.set_proposals("zz", 1)


# ---------------------------------------------------------------- engine, greedy
@pytest.fixture(scope="module")
def plain() -> list[list[int]]:
    llm = _llm()
    return _ids(_run(llm, SamplingParams(max_tokens=30, ignore_eos=True, temperature=0.0)))


def _oracle(llm: LLM, truth: list[list[int]], prompts: int, every: int = 3, k: int = 4) -> OracleProposer:
    """Install an oracle proposer in a fresh LLM, whose request ids are llm-0, llm-1, ... in prompt order."""
    oracle = OracleProposer({f"llm-{i}": t for i, t in enumerate(truth[:prompts])}, k, every)
    llm.engine.proposer = oracle
    return oracle


@pytest.mark.parametrize("options", [
    {}, {"policy": "decode_maximal"}, {"enable_prefix_caching": True}, {"token_budget": 9, "chunk_size": 5},
    {"num_kv_blocks": 9},  # preemptions by recompute mid-decode
], ids=["sarathi", "decode_maximal", "prefix_cache", "small_budget", "preemption"])
def test_greedy_outputs_equal_plain_decoding(plain: list[list[int]], options: dict) -> None:
    params = SamplingParams(max_tokens=30, ignore_eos=True, temperature=0.0)
    ngram = _llm(NGRAM, **options)
    outs = _run(ngram, params)
    assert _ids(outs) == plain
    assert _all_free(ngram)
    oracle_llm = _llm(NGRAM, **options)
    oracle = _oracle(oracle_llm, plain, len(PROMPTS))
    outs = _run(oracle_llm, params)
    assert _ids(outs) == plain
    assert _all_free(oracle_llm)
    assert set(oracle.released) == set(oracle.truth)  # each finished; a preempted one also released before
    drafted = sum(o.num_draft_tokens for o in outs)
    accepted = sum(o.num_accepted_tokens for o in outs)
    assert drafted > 0 and 0 < accepted < drafted
    base = _llm(**options)
    _run(base, params)
    if "num_kv_blocks" in options:
        assert oracle_llm.engine.num_preemptions > 0 and base.engine.num_preemptions > 0
    else:  # accepted proposals save steps
        assert oracle_llm.engine.num_steps < base.engine.num_steps


def test_greedy_with_logprobs_stop_tokens_max_tokens_and_n(plain: list[list[int]]) -> None:
    stop = plain[1][12]
    params = [SamplingParams(max_tokens=30, ignore_eos=True, temperature=0.0, logprobs=2),
              SamplingParams(max_tokens=30, ignore_eos=True, temperature=0.0, stop_token_ids=[stop]),
              SamplingParams(max_tokens=11, ignore_eos=True, temperature=0.0),
              SamplingParams(max_tokens=30, ignore_eos=True, temperature=0.0, n=2)]
    ref_llm, spec_llm = _llm(), _llm(NGRAM)
    ref = ref_llm.generate(PROMPTS, params, use_tqdm=False)
    _oracle(spec_llm, plain, len(PROMPTS), every=4)
    got = spec_llm.generate(PROMPTS, params, use_tqdm=False)
    for r, g in zip(ref, got):
        assert [list(s.token_ids) for s in r.outputs] == [list(s.token_ids) for s in g.outputs]
        assert [s.finish_reason for s in r.outputs] == [s.finish_reason for s in g.outputs]
    assert got[1].finish_reason == "stop" and got[1].token_ids[-1] == stop
    assert len(got[2].token_ids) == 11
    assert len(got[3].outputs) == 2
    assert got[0].logprobs is not None and ref[0].logprobs is not None
    for a, b in zip(ref[0].logprobs, got[0].logprobs):  # each token's logprob from its own row
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
    assert sum(o.num_accepted_tokens for o in got) > 0
    assert _all_free(spec_llm)


def test_abort_mid_speculation_frees_every_block(plain: list[list[int]]) -> None:
    llm = _llm(NGRAM)
    _oracle(llm, plain, 2)
    engine = llm.engine
    for i, prompt in enumerate(PROMPTS[:2]):
        engine.add_request(f"llm-{i}", prompt, SamplingParams(max_tokens=30, ignore_eos=True, temperature=0.0))
    verified = False
    while not verified:
        engine.step()
        verified = engine._seqs["llm-0"].metrics.num_draft_tokens > 0
    engine.abort("llm-0")
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert {o.request_id: o.finish_reason for o in outs if o.finished} == {"llm-0": "abort", "llm-1": "length"}
    assert [list(o.token_ids) for o in outs if o.request_id == "llm-1" and o.finished] == [plain[1]]
    assert _all_free(llm)


SMOLLM2_TEXT = ("def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n"
                "def factorial(n):\n    result = 1\n    for i in range(2, n + 1):\n        result *= i\n"
                "    return result\n")


@pytest.mark.slow
def test_smollm2_greedy_equals_plain_decoding() -> None:
    """The real model on input-grounded prompts (copy, edit a given file): the n-gram
    proposer finds the text in the prompt, most proposals are accepted, and the output is
    token for token the one plain decoding gives, with prefix caching on."""
    asks = ["Repeat this code exactly:\n\n", "Rename the function fibonacci to fib in this code and show it:\n\n",
            "Add a docstring to each function of this code:\n\n"]
    params = SamplingParams(temperature=0.0, max_tokens=40)
    options = {"num_kv_blocks": 96, "block_size": 16, "enable_prefix_caching": True}
    with LLM("smollm2-135m-instruct", **options) as llm:
        prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": a + SMOLLM2_TEXT}],
                                                     add_generation_prompt=True) for a in asks]
        plain_ids = _ids(llm.generate(prompts, params, use_tqdm=False))
    with LLM("smollm2-135m-instruct", speculative={"method": "ngram", "k": 4}, **options) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert _all_free(llm)
    assert _ids(outs) == plain_ids
    accepted, drafted = sum(o.num_accepted_tokens for o in outs), sum(o.num_draft_tokens for o in outs)
    assert accepted > 0.4 * drafted > 0


# -------------------------------------------------------------- engine, sampling
@pytest.mark.slow
def test_rejection_sampling_keeps_the_target_distribution(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tokens 2 and 3 of many seeded samples, with an oracle that proposes a fixed guess
    at them (accepted sometimes, rejected sometimes), against plain sampling: a
    two-sample chi-square test at significance 0.001 on each position's counts, every
    proposal verified (spec_sampling.verify_every_proposal)."""
    verify_every_proposal(monkeypatch)
    prompt = PROMPTS[0]
    seeds = range(600)
    params = [SamplingParams(max_tokens=4, ignore_eos=True, temperature=1.0, top_k=4, seed=s) for s in seeds]
    plain_outs = _run(_llm(max_num_seqs=32), params, [prompt] * len(params))
    greedy = _ids(_run(_llm(), SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0), [prompt]))[0]
    llm = _llm(NGRAM, max_num_seqs=32)
    llm.engine.proposer = _FixedGuess(greedy)
    spec_outs = _run(llm, params, [prompt] * len(params))
    assert sum(o.num_draft_tokens for o in spec_outs) > 0
    accepted = sum(o.num_accepted_tokens for o in spec_outs)
    assert 0 < accepted < sum(o.num_draft_tokens for o in spec_outs)
    for position in (1, 2):
        a = Counter(o.token_ids[position] for o in plain_outs)
        b = Counter(o.token_ids[position] for o in spec_outs)
        assert same_distribution_pvalue(a, b) > 0.001, (position, a, b)
    assert _all_free(llm)


class _FixedGuess(_OneByOne):
    """Proposes the greedy continuation's tokens 1.. after the first output token."""

    k = 2

    def __init__(self, greedy: list[int]) -> None:
        self.greedy = greedy

    def propose(self, seq: ProposalSource) -> list[int]:
        return self.greedy[1:3] if len(seq.output) == 1 else []

    def release(self, key: Hashable) -> None:
        pass


def test_metrics_export_proposed_accepted_and_the_rate(plain: list[list[int]]) -> None:
    pytest.importorskip("prometheus_client")
    from metrics_text import samples
    from sarathi_rt.server.stats import PREFIX, ServerStats

    llm = _llm(NGRAM)
    stats = ServerStats(llm.engine, "tiny")
    before = samples(stats.render()[0].decode())
    assert before[f"{PREFIX}spec_decode_num_draft_tokens_total"] == 0
    assert before[f"{PREFIX}spec_decode_acceptance_rate"] != before[f"{PREFIX}spec_decode_acceptance_rate"]  # NaN
    _oracle(llm, plain, len(PROMPTS))
    outs = _run(llm, SamplingParams(max_tokens=30, ignore_eos=True, temperature=0.0))
    m = samples(stats.render()[0].decode())
    drafted, accepted = sum(o.num_draft_tokens for o in outs), sum(o.num_accepted_tokens for o in outs)
    assert m[f"{PREFIX}spec_decode_num_draft_tokens_total"] == drafted > 0
    assert m[f"{PREFIX}spec_decode_num_accepted_tokens_total"] == accepted > 0
    assert m[f"{PREFIX}spec_decode_acceptance_rate"] == pytest.approx(accepted / drafted)


def test_n_samples_each_verify_their_own_proposals(plain: list[list[int]]) -> None:
    """n = 3 samples of each prompt drawn at temperature 1 with top_k = 1 (the random
    path of the sampler, rejection sampling included, with a point-mass distribution):
    each sample is asked for proposals at its own position and verifies them, and every
    sample's tokens are the greedy ones."""
    params = SamplingParams(max_tokens=30, ignore_eos=True, temperature=1.0, top_k=1, n=3, seed=5)
    llm = _llm(NGRAM)
    _oracle(llm, plain, len(PROMPTS), every=4)
    got = llm.generate(PROMPTS, params, use_tqdm=False)
    for ref, out in zip(plain, got):
        assert [list(s.token_ids) for s in out.outputs] == [ref] * 3
    samples = [s for out in got for s in out.outputs]
    assert any(s.index > 0 and s.num_accepted_tokens > 0 for s in samples)  # a forked sample speculated
    assert 0 < sum(s.num_accepted_tokens for s in samples) < sum(s.num_draft_tokens for s in samples)
    assert _all_free(llm)


def test_stop_strings_end_speculating_requests_where_plain_decoding_does(plain: list[list[int]]) -> None:
    """A stop string that a step's accepted proposals run past: the output ends where
    plain decoding's does, with the same text, and the tokens after it are dropped."""
    from text_models import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    stop = tokenizer.decode(plain[0][14:16])
    params = SamplingParams(max_tokens=30, ignore_eos=True, temperature=0.0, stop=[stop])
    ref = _llm(tokenizer=tokenizer).generate(PROMPTS, params, use_tqdm=False)
    llm = _llm(NGRAM, tokenizer=tokenizer)
    _oracle(llm, plain, len(PROMPTS), every=5)
    got = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [(list(o.token_ids), o.text, o.finish_reason) for o in got] == \
        [(list(o.token_ids), o.text, o.finish_reason) for o in ref]
    assert got[0].finish_reason == "stop" and len(got[0].token_ids) < 30
    assert sum(o.num_accepted_tokens for o in got) > 0
    assert _all_free(llm)
