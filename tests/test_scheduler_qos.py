"""QoS classes in the scheduler: validation, the FCFS baseline's exact equivalence, and
the deadline policy's properties (decodes never starved, every request finishes, the
prefill order is starvation-free, relegation, preemption preferences)."""
import math
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sarathi_rt.scheduler import QoSClass, SchedulerConfig, create_scheduler
from sarathi_rt.sim import simulate
from sarathi_rt.sim.cost import LinearCostModel
from sarathi_rt.step_time.shape import StepShape
from sarathi_rt.workloads import RequestSpec

CLASSES = {"chat": QoSClass(ttft=0.5, tbt=0.05, priority=1), "batch": QoSClass(ttft=20.0, tbt=1.0)}
COST = LinearCostModel(fixed_s=0.01, per_token_s=1e-4)


# ------------------------------------------------------------------ validation
@pytest.mark.parametrize("field,value", [("ttft", 0), ("ttft", -1.0), ("tbt", math.inf), ("tbt", math.nan),
                                         ("ttft", True), ("tbt", "0.1")])
def test_qos_class_rejects_bad_deadlines(field, value):
    kwargs = {"ttft": 1.0, "tbt": 0.1, field: value}
    with pytest.raises(ValueError, match=field):
        QoSClass(**kwargs)


def test_qos_class_cumulative_deadlines():
    c = QoSClass(ttft=1.0, tbt=0.1)
    assert c.deadline(10.0, 0) == 11.0 and c.deadline(10.0, 3) == pytest.approx(11.3)
    # gaps of 0.55 s and 0.13 s against a tbt of 0.1 s: the early first token made room
    assert c.attained(0.0, [0.5, 1.05, 1.18], finished=True)
    assert not c.attained(0.0, [0.5, 1.05, 1.25], finished=True)
    assert not c.attained(0.0, [0.5], finished=False)


@pytest.mark.parametrize("kwargs,match", [
    ({"default_qos": "chat"}, "default_qos 'chat' needs qos_classes"),
    ({"qos_classes": CLASSES, "default_qos": "gold"}, "default_qos must be one of"),
    ({"qos_classes": {}}, "qos_classes must be a non-empty"),
    ({"qos_classes": {"chat": {"ttft": 1.0}}}, r"qos_classes\['chat'\] needs keys ttft and tbt"),
    ({"qos_classes": {"chat": {"ttft": -1.0, "tbt": 0.1}}}, r"qos_classes\['chat'\]: ttft must be"),
    ({"qos_classes": CLASSES, "qos_policy": "edf"}, "qos_policy must be one of"),
    ({"qos_classes": CLASSES, "qos_srpf_weight": -1.0}, "qos_srpf_weight"),
    ({"qos_classes": CLASSES, "policy": "vllm", "token_budget": 4096, "qos_policy": "deadline"},
     "qos_policy 'deadline' is not supported"),
])
def test_config_rejects_bad_qos(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SchedulerConfig(**kwargs)


def test_config_accepts_class_dicts_and_fcfs_on_any_policy():
    cfg = SchedulerConfig(qos_classes={"chat": {"ttft": 1, "tbt": 0.1}}, qos_policy="fcfs", policy="vllm",
                          token_budget=4096)
    assert cfg.qos_classes["chat"] == QoSClass(1, 0.1) and not cfg.deadline_aware
    assert not cfg.needs_step_time_model
    assert SchedulerConfig(qos_classes=CLASSES).needs_step_time_model


def test_add_request_rejects_bad_classes_and_keeps_serving():
    s = create_scheduler(SchedulerConfig(qos_classes=CLASSES), COST)
    with pytest.raises(ValueError, match="qos must be one of"):
        s.add_request("a", 10, 5, qos="gold", arrival_time=0.0)
    with pytest.raises(ValueError, match="qos is required"):
        s.add_request("a", 10, 5, arrival_time=0.0)
    with pytest.raises(ValueError, match="arrival_time"):
        s.add_request("a", 10, 5, qos="chat", arrival_time=math.nan)
    with pytest.raises(ValueError, match="no qos_classes"):
        create_scheduler(SchedulerConfig()).add_request("a", 10, 5, qos="chat")
    with pytest.raises(ValueError, match="step_time_model is required"):
        create_scheduler(SchedulerConfig(qos_classes=CLASSES))
    s.add_request("a", 10, 2, qos="chat", arrival_time=0.0)
    assert s.request_info("a").qos == "chat"
    while s.has_unfinished():
        s.update(s.schedule(now=0.0))


# ------------------------------------------------------- random traffic driver
request_st = st.tuples(st.floats(0, 2), st.integers(1, 600), st.integers(1, 30), st.sampled_from(["chat", "batch"]))
scenario_st = st.fixed_dictionaries({
    "requests": st.lists(request_st, min_size=1, max_size=14),
    "token_budget": st.sampled_from([64, 256]),
    "num_blocks": st.integers(40, 120),
    "tile_size": st.sampled_from([None, 32]),
    "max_partial_prefills": st.integers(1, 2),
    "depth": st.sampled_from([1, 2]),
    "weight": st.sampled_from([0.0, 1.0, 50.0]),
})


def drive(cfg, requests, depth=1, with_classes=True, classes=CLASSES):
    """Run `requests` (arrival s, prompt, max_new, class) on a clock that advances by
    the cost model's step time; returns the plans (as tuples) and the scheduler, and
    sets `drive.stepped_aside` to how many decodes were left out of a step. Checks every
    step: no running decode is left out, except by the deadline policy when its next
    token still makes its cumulative deadline (checked when that token comes)."""
    sched = create_scheduler(cfg, COST if cfg.needs_step_time_model else None)
    todo = sorted(enumerate(requests), key=lambda x: (x[1][0], x[0]))
    now, pending, plans, finished = 0.0, [], [], []
    due = {}  # request left out of a step -> when its next token is due
    drive.stepped_aside = 0
    while todo or sched.has_unfinished() or pending:
        assert len(plans) < 20_000, "no progress"
        while todo and todo[0][1][0] <= now:
            rid, (t, prompt, max_new, qos) = todo.pop(0)
            sched.add_request(rid, prompt, max_new, qos=qos if with_classes else None, arrival_time=t)
        in_flight = {e.request_id for p, _ in pending for e in p.entries}
        idle_decodes = {rid for rid in range(len(requests)) if rid not in in_flight and _is_decode(sched, rid)}
        plan = sched.schedule(now)
        for rid in plan.preempted:
            due.pop(rid, None)  # recomputed: late for that, not for stepping aside
        left_out = idle_decodes - {e.request_id for e in plan.entries} - set(plan.preempted)
        assert not left_out or cfg.deadline_aware, "a running decode was left out"
        for rid in left_out:
            info = sched.request_info(rid)
            assert not info.relegated
            due.setdefault(rid, classes[info.qos].deadline(requests[rid][0], info.num_generated))
        drive.stepped_aside += len(left_out)
        assert plan.num_tokens <= cfg.token_budget
        plans.append(tuple((e.request_id, e.start_pos, e.num_tokens) for e in plan.entries))
        now += COST.predict_shape(StepShape.of_plan(plan)) if plan.entries else 0.05
        pending.append((plan, now))
        while pending and (len(pending) >= depth or plan.is_empty):
            done, end = pending.pop(0)
            for e in done.entries:
                if e.emits_token and e.request_id in due:
                    assert end <= due.pop(e.request_id) + 1e-9, "a decode that stepped aside came late"
            finished += sched.update(done)
    assert sorted(finished) == list(range(len(requests)))
    assert sched.num_free_blocks == cfg.num_blocks
    return plans, sched


def _is_decode(sched, rid):
    try:
        info = sched.request_info(rid)
    except KeyError:
        return False
    # A decode has computed the KV of its prompt and of every generated token but the
    # last (which it feeds back next). After a recompute the same counts also fit a
    # prefill one token short of its end, so requests preempted once are not checked.
    return info.status.value == "running" and info.num_preemptions == 0 and info.num_generated >= 1 and \
        info.num_computed >= info.num_prompt_tokens + info.num_generated - 1


def _config(sc, **kw):
    return SchedulerConfig(token_budget=sc["token_budget"], num_blocks=sc["num_blocks"], max_num_seqs=16,
                           tile_size=sc["tile_size"], max_partial_prefills=sc["max_partial_prefills"], **kw)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sc=scenario_st)
def test_fcfs_qos_schedules_exactly_as_without_classes(sc):
    plain, _ = drive(_config(sc), sc["requests"], sc["depth"], with_classes=False)
    fcfs, _ = drive(_config(sc, qos_classes=CLASSES, qos_policy="fcfs"), sc["requests"], sc["depth"])
    assert fcfs == plain


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sc=scenario_st)
def test_deadline_policy_never_starves_a_decode_and_finishes_everyone(sc):
    drive(_config(sc, qos_classes=CLASSES, qos_srpf_weight=sc["weight"]), sc["requests"], sc["depth"])


def test_slack_decodes_step_aside_only_while_their_deadlines_hold():
    """Random traffic built to make stepping aside pay: a crowd of batch requests with
    short prompts and long decodes (slack: tbt 1 s), then long chat prompts whose first
    token they would delay. Every decode left out of a step still gets its next token
    by its cumulative deadline (drive checks it at that token), every request
    finishes, and decodes do step aside."""
    rng = random.Random(7)
    stepped = 0
    for _ in range(3):
        reqs = [(rng.uniform(0, 0.5), rng.randint(8, 32), rng.randint(200, 600), "batch")
                for _ in range(rng.randint(150, 240))]
        reqs += [(rng.uniform(4.0, 8.0), rng.randint(500, 3000), rng.randint(1, 20), "chat")
                 for _ in range(rng.randint(3, 8))]
        cfg = SchedulerConfig(token_budget=256, max_num_seqs=256, num_blocks=8192, qos_classes=CLASSES)
        drive(cfg, reqs)
        stepped += drive.stepped_aside
    assert stepped > 0


def test_stepping_aside_saves_a_chat_prompt_behind_slack_decodes():
    """200 batch decodes fill 200 of 256 budget tokens; a 1500-token chat prompt at 56
    tokens a step would take ~1 s against its 0.5 s deadline. The batch decodes step
    aside (their tbt is 1 s) and it makes it; no batch request misses a deadline."""
    reqs = [(0.0, 16, 600, "batch")] * 200 + [(8.0, 1500, 4, "chat")]
    runs = {p: _sim(reqs, qos_policy=p, token_budget=256, max_num_seqs=256) for p in ("fcfs", "deadline")}
    assert runs["fcfs"].requests[200].ttft > CLASSES["chat"].ttft
    assert runs["deadline"].requests[200].ttft <= CLASSES["chat"].ttft
    assert runs["deadline"].summary().qos["batch"].attainment == 1.0


# ----------------------------------------------------------- order and relegation
def _sim(requests, **kw):
    kw = {"token_budget": 512, "max_num_seqs": 64, **kw}
    cfg = SchedulerConfig(num_blocks=4096, qos_classes=CLASSES, **kw)
    specs = [RequestSpec(i, t, p, d, qos=q) for i, (t, p, d, q) in enumerate(requests)]
    return simulate(specs, cfg, COST)


def test_chat_prompt_overtakes_a_long_batch_prefill():
    # A 20k-token batch prompt arrives first; a chat prompt 0.1 s later.
    reqs = [(0.0, 20_000, 4, "batch"), (0.1, 200, 4, "chat")]
    fcfs, dl = _sim(reqs, qos_policy="fcfs"), _sim(reqs)
    assert fcfs.requests[1].ttft > CLASSES["chat"].ttft  # FCFS: stuck behind the batch prompt
    assert dl.requests[1].ttft <= CLASSES["chat"].ttft
    assert dl.requests[0].ttft <= CLASSES["batch"].ttft  # the batch prompt still makes its own


@pytest.mark.parametrize("weight", [0.0, 1.0, 1e4])
def test_prefill_order_is_starvation_free(weight):
    """Adversarial for shortest-remaining-first: a long batch prompt, then an endless
    stream of short chat prompts (about 60% of the capacity) each of which is shorter
    and due sooner. The long prompt's key is fixed while each newcomer's grows with its
    arrival, so the long prompt's turn comes; and if it is relegated, the stream leaves
    budget over. Either way it finishes, within a bound."""
    per_step_tokens, step_s = 512, COST.predict_shape(StepShape(num_prefill_tokens=512))
    rate = 0.6 * per_step_tokens / step_s / 256  # short prompts per second at 60% load
    reqs = [(0.0, 8000, 2, "batch")] + [(0.01 + i / rate, 256, 1, "chat") for i in range(int(60 * rate))]
    res = _sim(reqs, qos_srpf_weight=weight)
    long = res.requests[0]
    assert long.finish_time is not None
    key = CLASSES["batch"].ttft + weight * 8000 * step_s / per_step_tokens
    # its own prefill at the 40% of the steps the stream leaves, after its key is reached
    bound = key + 8000 / (0.4 * per_step_tokens) * step_s + 1.0
    assert long.ttft <= bound, (long.ttft, bound)
    assert all(r.finish_time is not None for r in res.requests)


def test_hopeless_requests_are_relegated_served_last_and_reported():
    # 40 chat prompts at once, each 2000 tokens: about 16 fit in the 0.5 s deadline.
    reqs = [(0.0, 2000, 2, "chat") for _ in range(40)]
    res = _sim(reqs)
    relegated = [r for r in res.requests if r.relegated]
    kept = [r for r in res.requests if not r.relegated]
    assert relegated and kept and all(r.finish_time is not None for r in res.requests)  # never dropped
    assert max(r.first_token_time for r in kept) <= min(r.first_token_time for r in relegated)
    summary = res.summary().qos["chat"]
    assert summary.relegated == len(relegated) and summary.num_requests == 40
    assert summary.attainment >= len(kept) / 40 * 0.9
    fcfs = _sim(reqs, qos_policy="fcfs").summary().qos["chat"]
    assert summary.attainment > fcfs.attainment  # FCFS makes the late ones make everyone late


def test_preemption_takes_relegated_and_slack_requests_first():
    cfg = SchedulerConfig(token_budget=64, max_num_seqs=8, block_size=4, num_blocks=16, watermark=0.0,
                          qos_classes=CLASSES)
    s = create_scheduler(cfg, COST)
    s.add_request("batch", 20, 30, qos="batch", arrival_time=0.0)
    s.add_request("chat", 20, 30, qos="chat", arrival_time=0.0)
    preempted, now = [], 0.0
    while s.has_unfinished():
        plan = s.schedule(now)
        preempted += plan.preempted
        s.update(plan)
        now += 0.02
    # Both need 13 blocks of 16: the chat request (newest, tighter) keeps its blocks.
    assert preempted and set(preempted) == {"batch"}


def test_under_overload_the_tight_class_keeps_its_deadlines():
    """Chat and batch prompts at about twice what FCFS sustains: FCFS misses nearly
    every chat deadline; the deadline policy (priority, relegation, urgent chunks)
    keeps most, and the total goodput does not drop."""
    from sarathi_rt.workloads import WorkloadConfig, make_workload

    reqs = make_workload(WorkloadConfig(num_requests=120, qps=12, lengths="uniform", prompt_range=(64, 2048),
                                        decode_range=(8, 64), qos_mix={"chat": 0.35, "batch": 0.65}))
    runs = {}
    for policy in ("fcfs", "deadline"):
        cfg = SchedulerConfig(token_budget=512, max_num_seqs=64, num_blocks=2048, qos_classes=CLASSES,
                              qos_policy=policy)
        runs[policy] = simulate(reqs, cfg, COST).summary().qos
    missed = {p: round(q["chat"].num_requests * (1 - q["chat"].attainment)) for p, q in runs.items()}
    assert missed["fcfs"] >= 10 * max(1, missed["deadline"])
    assert sum(q.goodput for q in runs["deadline"].values()) >= sum(q.goodput for q in runs["fcfs"].values())


def test_the_head_gets_the_chunk_that_makes_its_deadline_with_every_decode_kept(monkeypatch):
    """A step sized below what the best-ranked prompt needs (here forced to one prefill
    token), when a chunk within the step limit with every decode kept would make its
    first-token deadline: the step takes that chunk rather than leave the deadline on
    the table (nobody needs to step aside)."""
    from sarathi_rt.scheduler.adaptive import AdaptiveBudget

    cost = LinearCostModel(fixed_s=0.01, per_token_s=1e-4)
    cfg = SchedulerConfig(token_budget=512, max_num_seqs=8, num_blocks=512, qos_classes=CLASSES, default_qos="chat")
    s = create_scheduler(cfg, cost)
    s.add_request("d", 8, 50, arrival_time=0.0)
    now = 0.0
    while s.request_info("d").num_generated < 2:  # "d" decodes
        plan = s.schedule(now)
        now += cost.predict_shape(StepShape.of_plan(plan))
        s.update(plan)
    s.add_request("p", 300, 4, arrival_time=now - 0.45)  # 0.05 s left of its 0.5 s ttft: one chunk of 300 makes it
    size = AdaptiveBudget.size

    def too_small(self, b, prefills, decodes):
        size(self, b, prefills, decodes)
        b.budget = b.plan.num_decode_tokens + 1

    monkeypatch.setattr(AdaptiveBudget, "size", too_small)
    plan = s.schedule(now)
    assert {e.request_id for e in plan.entries} == {"d", "p"} and plan.num_prefill_tokens == 300
    assert now + cost.predict_shape(StepShape.of_plan(plan)) <= now - 0.45 + 0.5


@pytest.mark.parametrize("fixed_s,per_token_s", [(0.02, 1e-4), (0.05, 1e-3), (0.1, 2e-3), (0.3, 3e-3)])
def test_relegation_never_inverts_the_tiers(fixed_s, per_token_s):
    """The server's default tiers under contention: 40 flex requests, then 8 probes of
    each tier. Where the machine is too slow for the priority tier's 1 s TTFT its probes
    are relegated; they must still come before the default tier's and those before the
    flex tier's at the median (they used to wait behind all of the flex work: priority
    7-41 s against flex 12-35 s on these step times)."""
    import statistics

    from sarathi_rt.commands.serve import DEFAULT_SERVICE_TIERS as tiers

    cost = LinearCostModel(fixed_s=fixed_s, per_token_s=per_token_s)
    s = create_scheduler(SchedulerConfig(token_budget=512, max_num_seqs=64, num_blocks=8192, qos_classes=tiers,
                                         default_qos="default"), cost)
    now, step, arrived, first = 0.0, 0, {}, {}
    for i in range(40):
        s.add_request(("stream", i), 200, 50, qos="flex", arrival_time=now)
    while s.has_unfinished():
        if step == 3:
            for k in range(8):
                for tier in tiers:
                    s.add_request(("probe", tier, k), 200, 8, qos=tier, arrival_time=now)
                    arrived[("probe", tier, k)] = now
        plan = s.schedule(now)
        now += cost.predict_shape(StepShape.of_plan(plan)) if plan.entries else 0.05
        first.update((e.request_id, now) for e in plan.entries if e.emits_token and e.request_id not in first)
        s.update(plan)
        step += 1
    median = {tier: statistics.median(first[("probe", tier, k)] - arrived[("probe", tier, k)] for k in range(8))
              for tier in tiers}
    assert median["priority"] <= median["default"] <= median["flex"], median
