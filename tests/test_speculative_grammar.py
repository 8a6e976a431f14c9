"""Speculative decoding of structured-output requests (SamplingParams.json_schema): the
grammar cuts each proposal at the first token it refuses and masks each verification row
as of its own position, and the matcher is rolled back after both, so it only ever
advances by the tokens a request keeps. Greedy outputs are token for token those of
plain decoding (the n-gram proposer, a draft model, and an oracle whose planted errors
the grammar cuts); sampled outputs parse and validate, and equal plain sampling where its
distribution is a point mass and before the first verification; a stop string inside
accepted proposals, max_tokens and an abort mid-speculation end requests where plain
decoding does; every KV block is free after each run."""
from __future__ import annotations

import json
from typing import Hashable

import pytest

from structured_schemas import schemas
from text_models import tiny_tokenizer
from sarathi_rt import LLM, SamplingParams
from sarathi_rt.engine.step_io import RowSampling, SequenceChunk
from sarathi_rt.engine.structured import Grammar, GrammarCompiler
from sarathi_rt.scheduler.drafting import Drafting
from sarathi_rt.spec import ProposalSource

xgrammar = pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

NGRAM = {"method": "ngram", "k": 4, "ngram_min": 1, "ngram_max": 3}
# JSON text in the prompts, so that the n-gram proposer finds the keys, quotes and
# punctuation the grammar writes and proposes them.
EXAMPLE = '{"id": 7, "name": "ab", "tags": ["red", "green"], "ok": true, "score": 3, "x": null} '
# Objects and arrays from structured_schemas, whose values a random model fills at length.
SCHEMAS = [json.dumps(s) for s in schemas()[16:24]]
PROMPTS = [EXAMPLE * 2 + "name " * i for i in range(len(SCHEMAS))]
TOKENIZER = tiny_tokenizer()


def _llm(speculative: dict | None = None, model: str = "tiny", **options: object) -> LLM:
    return LLM(model, tokenizer=TOKENIZER, speculative=speculative,
               **{"num_kv_blocks": 192, "block_size": 8, "enable_prefix_caching": False, **options})


def _all_free(llm: LLM) -> bool:
    return llm.engine.scheduler.num_free_blocks == llm.engine.scheduler_config.num_blocks


def _greedy(max_tokens: int = 120) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=max_tokens, temperature=0.0, json_schema=s) for s in SCHEMAS]


def _key(out: object) -> tuple:
    return list(out.token_ids), out.text, out.finish_reason


def _valid(outs: list, params: list[SamplingParams]) -> None:
    for out, p in zip(outs, params):
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), json.loads(p.json_schema))


class CutCounter:
    """Wraps Grammar.cut to count the proposals it was given and those it kept."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.given = self.kept = 0
        cut = Grammar.cut

        def counting(grammar: Grammar, draft: list[int]) -> list[int]:
            kept = cut(grammar, draft)
            self.given += len(draft)
            self.kept += len(kept)
            return kept

        monkeypatch.setattr(Grammar, "cut", counting)


class Oracle:
    """Proposes each request's true continuation (`truth`, by request id) with every
    `every`-th position replaced by a token the grammar is bound to refuse there (BOS, a
    special token) or, alternately, by a byte the model may refuse; k at a time."""

    k = 4

    def __init__(self, truth: dict[Hashable, list[int]], every: int = 3) -> None:
        self.truth, self.every = truth, every

    def propose_batch(self, seqs: list[ProposalSource], rooms: list[int]) -> list[list[int]]:
        out = []
        for seq, room in zip(seqs, rooms):
            done = len(seq.output)
            true = self.truth[seq.key][done:done + min(self.k, max(room, 0))]
            out.append([t if (done + i) % self.every else (0 if (done + i) % 2 else (t + 1) % 512)
                        for i, t in enumerate(true)])
        return out

    def release(self, key: Hashable) -> None:
        pass


@pytest.fixture(scope="module")
def plain() -> list:
    llm = _llm()
    outs = llm.generate(PROMPTS, _greedy(), use_tqdm=False)
    _valid(outs, _greedy())
    return outs


# ----------------------------------------------------------------------- the grammar
def test_cut_and_row_masks_leave_the_matcher_where_it_was() -> None:
    compiler = GrammarCompiler(TOKENIZER, 512, (2,))
    schema = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
    value = TOKENIZER.encode('{"a": 12}')
    grammar, fresh = compiler.grammar(schema, frozenset({2})), compiler.grammar(schema, frozenset({2}))
    start = grammar.allowed()
    # The whole value is kept; the EOS that completes it and what follows are not.
    assert grammar.cut(value + [2, 40]) == value
    assert grammar.cut([value[0], 300, value[1]]) == [value[0]]  # 300 ("aa..."): no JSON after "{"
    assert grammar.cut([0, *value]) == []  # a special token: refused without asking xgrammar
    assert grammar.allowed() == start
    masks = grammar.allowed_after(value[:4])
    assert grammar.allowed() == start
    for token, mask in zip(value[:4], masks):  # row i's mask: the grammar after i proposals
        fresh.accept(token)
        assert fresh.allowed() == mask
    assert len(set(masks)) > 1
    with pytest.raises(ValueError, match="draft holds token 300 at 1"):
        grammar.allowed_after([value[0], 300])
    assert grammar.allowed() == start
    assert not grammar.accept(value[0])  # the matcher still starts the value


def test_verify_rows_carry_each_rows_mask() -> None:
    first = RowSampling(0.0, None, 1.0, 5, 3, allowed=b"a")
    chunk = SequenceChunk("r", [9, 10, 11], 20, [0, 1, 2], first, num_draft=2, draft_allowed=(b"b", b"c"))
    assert [(r.num_generated, r.allowed) for r in chunk.verify_rows()] == [(3, b"a"), (4, b"b"), (5, b"c")]
    free = SequenceChunk("r", [9, 10, 11], 20, [0, 1, 2], RowSampling(0.0, None, 1.0, 5, 3), num_draft=2)
    assert [r.allowed for r in free.verify_rows()] == [None] * 3
    chunk.draft_allowed = (b"b",)
    with pytest.raises(ValueError, match=r"draft_allowed must hold one mask per proposal \(2\), got 1"):
        chunk.verify_rows()
    with pytest.raises(ValueError, match="verifies no proposals"):
        SequenceChunk("r", [9], 20, [0], first).verify_rows()


# ------------------------------------------------------------------------ greedy
@pytest.mark.parametrize("options", [
    {}, {"policy": "decode_maximal"}, {"enable_prefix_caching": True},
    {"num_kv_blocks": 48},  # preemptions by recompute: the matcher keeps the generated tokens
], ids=["sarathi", "decode_maximal", "prefix_cache", "preemption"])
def test_ngram_greedy_equals_plain_decoding(plain: list, options: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """The n-gram proposer finds the prompt's JSON text: drafts are verified, some the
    grammar cuts, some the target rejects, and the outputs are plain decoding's."""
    cuts = CutCounter(monkeypatch)
    llm = _llm(NGRAM, **options)
    outs = llm.generate(PROMPTS, _greedy(), use_tqdm=False)
    assert [_key(o) for o in outs] == [_key(o) for o in plain]
    drafted, accepted = sum(o.num_draft_tokens for o in outs), sum(o.num_accepted_tokens for o in outs)
    assert 0 < accepted < drafted
    assert 0 < cuts.kept < cuts.given
    assert (llm.engine.num_preemptions > 0) == ("num_kv_blocks" in options)
    assert _all_free(llm)


def test_oracle_with_refused_proposals_and_free_requests_beside(plain: list, monkeypatch: pytest.MonkeyPatch
                                                                ) -> None:
    """An oracle proposing the true continuation with planted tokens the grammar refuses:
    the cut keeps the true run before each, the target accepts it (fewer steps than plain
    decoding), and free requests in the same batch speculate and decode as without."""
    free = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    params = [*_greedy(), free, free]
    prompts = [*PROMPTS, PROMPTS[0], PROMPTS[1]]
    base = _llm()
    ref = base.generate(prompts, params, use_tqdm=False)
    cuts = CutCounter(monkeypatch)
    llm = _llm(NGRAM)
    llm.engine.proposer = Oracle({f"llm-{i}": list(o.token_ids) for i, o in enumerate(ref)})
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [_key(o) for o in outs] == [_key(o) for o in ref]
    assert 0 < cuts.kept < cuts.given
    assert all(o.num_accepted_tokens > 0 for o in outs)
    # The planted bytes the grammar allows there, the target rejects.
    assert sum(o.num_accepted_tokens for o in outs) < sum(o.num_draft_tokens for o in outs)
    assert llm.engine.num_steps < base.engine.num_steps
    assert _all_free(llm)


def test_draft_model_greedy_equals_plain_decoding(monkeypatch: pytest.MonkeyPatch) -> None:
    """tiny drafting for tiny-deep (its unconstrained guesses: the grammar cuts most) and
    tiny-deep drafting for itself (it guesses the argmax without the mask: the rows'
    masks decide what is accepted)."""
    params = _greedy(80)
    ref = _llm(model="tiny-deep").generate(PROMPTS[:4], params[:4], use_tqdm=False)
    # Drafts priced by the token budget alone: the step-time model learns from wall-clock
    # steps, and on a loaded machine it priced every one of tiny's low-acceptance drafts
    # out (no draft at all in one run), which would leave nothing here to check.
    monkeypatch.setattr(Drafting, "_with_drafts", lambda self, shape, context: None)
    for draft in ("tiny", "tiny-deep"):
        cuts = CutCounter(monkeypatch)
        llm = _llm({"method": "draft", "model": draft, "k": 3}, model="tiny-deep")
        outs = llm.generate(PROMPTS[:4], params[:4], use_tqdm=False)
        assert [_key(o) for o in outs] == [_key(o) for o in ref], draft
        assert sum(o.num_draft_tokens for o in outs) > 0, draft
        assert cuts.kept < cuts.given, draft
        assert _all_free(llm)
        proposer = llm.engine.proposer
        assert proposer.num_free_blocks == proposer.num_blocks


def test_completion_and_max_tokens_end_requests_where_plain_decoding_does(plain: list) -> None:
    """The oracle proposes each value's end (its closing token, then EOS): the cut leaves
    the completing token to the target, so the request ends there as without proposals
    (with ignore_eos, at the closing token); a max_tokens inside accepted proposals cuts
    the output as plain decoding's."""
    params = [SamplingParams(max_tokens=120, temperature=0.0, json_schema=SCHEMAS[0]),
              SamplingParams(max_tokens=120, temperature=0.0, json_schema=SCHEMAS[1], ignore_eos=True),
              SamplingParams(max_tokens=13, temperature=0.0, json_schema=SCHEMAS[2])]
    ref = _llm().generate(PROMPTS[:3], params, use_tqdm=False)
    assert [o.finish_reason for o in ref] == ["stop", "stop", "length"]
    assert ref[0].token_ids[-1] == 2 and ref[1].token_ids[-1] != 2
    llm = _llm(NGRAM)
    truth = {f"llm-{i}": list(o.token_ids) + [2] for i, o in enumerate(ref)}
    llm.engine.proposer = Oracle(truth, every=100)  # no planted errors
    outs = llm.generate(PROMPTS[:3], params, use_tqdm=False)
    assert [_key(o) for o in outs] == [_key(o) for o in ref]
    assert all(0 < o.num_accepted_tokens == o.num_draft_tokens for o in outs)
    assert _all_free(llm)


def test_abort_mid_speculation(plain: list) -> None:
    llm = _llm(NGRAM)
    llm.engine.proposer = Oracle({f"llm-{i}": list(o.token_ids) for i, o in enumerate(plain[:2])})
    engine = llm.engine
    for i, p in enumerate(_greedy()[:2]):
        engine.add_request(f"llm-{i}", TOKENIZER.encode(PROMPTS[i]), p)
    while engine._seqs["llm-0"].metrics.num_draft_tokens == 0:
        engine.step()
    engine.abort("llm-0")
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    finished = {o.request_id: o for o in outs if o.finished}
    assert finished["llm-0"].finish_reason == "abort"
    assert _key(finished["llm-1"]) == _key(plain[1])
    assert _all_free(llm)


# ---------------------------------------------------------------------- sampling
def test_sampled_outputs_validate_and_match_plain_where_it_is_determined(monkeypatch: pytest.MonkeyPatch) -> None:
    """Temperature 1: every output parses and validates. At top_k 1 (a point mass: the
    same for rejection sampling) each equals plain sampling's with the same seed, n = 2
    samples included. With the whole distribution, rejection sampling draws its own
    uniforms at a judged row (the same law, not the same bits, as for requests without
    a grammar), so an output equals plain sampling's up to the step that first verifies
    a proposal."""
    point = [SamplingParams(max_tokens=120, temperature=1.0, top_k=1, seed=i, json_schema=s, n=2 if i < 2 else 1)
             for i, s in enumerate(SCHEMAS)]
    sampled = [SamplingParams(max_tokens=160, temperature=1.0, seed=i, json_schema=s) for i, s in enumerate(SCHEMAS)]
    base = _llm()
    ref_point = base.generate(PROMPTS, point, use_tqdm=False)
    ref = base.generate(PROMPTS, sampled, use_tqdm=False)
    cuts = CutCounter(monkeypatch)
    llm = _llm(NGRAM)
    got_point = llm.generate(PROMPTS, point, use_tqdm=False)
    samples = [[_key(s) for s in o.outputs] for o in got_point]
    assert samples == [[_key(s) for s in o.outputs] for o in ref_point]
    assert [len(s) for s in samples[:3]] == [2, 2, 1]  # n = 2: each sample with its own grammar
    assert all(s.num_accepted_tokens > 0 for o in got_point[:2] for s in o.outputs)
    engine = llm.engine
    for i, p in enumerate(sampled):
        engine.add_request(i, TOKENIZER.encode(PROMPTS[i]), p)
    before_first: dict[int, int] = {}  # request -> tokens it had when it first verified
    outs = []
    while engine.has_unfinished():
        lengths = {key: len(seq.output) for key, seq in engine._seqs.items() if not seq.metrics.num_draft_tokens}
        step = engine.step()
        before_first |= {o.request_id: lengths[o.request_id] for o in step
                         if o.num_draft_tokens and o.request_id in lengths}
        outs += step
    got = sorted((o for o in outs if o.finished), key=lambda o: o.request_id)
    _valid(got, sampled)
    assert len(before_first) > len(SCHEMAS) // 2 and cuts.kept < cuts.given
    assert sum(o.num_accepted_tokens for o in got) > 0
    for i, (r, g) in enumerate(zip(ref, got)):
        same = before_first.get(i, len(r.token_ids))
        assert list(g.token_ids)[:same] == list(r.token_ids)[:same]
    assert _all_free(llm)
