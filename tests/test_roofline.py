"""The roofline's arithmetic (sarathi_rt.measure.roofline) and the roofline bench's time
split (bench/bench_roofline_cpu.py on harness.step_split) and the engine-level split, on `tiny`."""
from __future__ import annotations

import math
import time
import sys
from pathlib import Path

import pytest

from sarathi_rt.measure.roofline import ModelCost, StepRow, busy_warning, own_load, step_bytes, step_flops

COST = ModelCost(layer_params=1000, head_params=300, weight_bytes=5200, kv_bytes_per_token=12)


def test_flops_count_the_head_only_for_logits_rows() -> None:
    decodes = [StepRow(context=10, num_tokens=1, logits=True)] * 4
    assert step_flops(COST, decodes) == 2 * (1000 * 4 + 300 * 4)
    chunk = [StepRow(context=0, num_tokens=64, logits=False)]
    assert step_flops(COST, chunk) == 2 * 1000 * 64
    assert step_flops(COST, [StepRow(0, 64, True)]) == 2 * (1000 * 64 + 300)


def test_bytes_read_the_weights_once_and_every_rows_kv() -> None:
    decodes = [StepRow(context=10, num_tokens=1, logits=True)] * 4
    # each row reads its 10 cached tokens and its new one, and writes the new one
    assert step_bytes(COST, decodes) == 5200 + 12 * 4 * (11 + 1)
    assert step_bytes(COST, [StepRow(0, 64, True)]) == 5200 + 12 * (64 + 64)


@pytest.mark.parametrize("rows", [[], [StepRow(-1, 1, True)], [StepRow(0, 0, True)]])
def test_bad_rows_are_refused(rows: list[StepRow]) -> None:
    with pytest.raises(ValueError, match="row"):
        step_bytes(COST, rows)


@pytest.mark.parametrize("field", ["layer_params", "head_params", "weight_bytes", "kv_bytes_per_token"])
def test_model_cost_names_a_bad_field(field: str) -> None:
    values = {"layer_params": 1, "head_params": 1, "weight_bytes": 1, "kv_bytes_per_token": 1, field: 0}
    with pytest.raises(ValueError, match=field):
        ModelCost(**values)


def test_own_load_follows_the_load_averages_decay() -> None:
    assert own_load(2, 0.0) == 0.0
    assert own_load(2, 60.0) == pytest.approx(2 * (1 - math.exp(-1)))
    assert own_load(1, 6000.0) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="threads"):
        own_load(0, 1.0)


def test_a_quiet_machine_gets_no_warning() -> None:
    # after a long run the load is our own thread's: no one else was there
    assert busy_warning(0.1, 1.0, cores=2, threads=1, run_seconds=600) is None
    assert busy_warning(0.3, 2.1, cores=2, threads=2, run_seconds=600) is None


@pytest.mark.parametrize("before, after, threads", [(1.9, 1.9, 1), (0.0, 2.9, 2), (1.0, 1.0, 2)])
def test_other_work_on_our_cores_is_a_busy_machine(before: float, after: float, threads: int) -> None:
    line = busy_warning(before, after, cores=2, threads=threads, run_seconds=600)
    assert line is not None and line.startswith("WARNING: busy machine") and "busy machine" in line


def test_step_split_adds_up_to_the_step_and_leaves_the_model_as_it_was() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    from bench_roofline_cpu import SPLIT, StepSplit, model_cost, regimes, split_ms, worker_of

    from sarathi_rt import LLM
    from sarathi_rt.harness.step_timing import time_steps

    llm = LLM("tiny", num_kv_blocks=64, max_num_seqs=8, token_budget=64)
    worker = worker_of(llm)
    sampler, steps = worker.sampler, [rows for _, rows in regimes([8], [32], 16)]
    with StepSplit(worker) as split:
        for rows in steps:
            split.reset()
            wall = time_steps(llm.engine, [rows], repeats=1, warmup=0)[0][0]
            ms = split_ms(split, wall)
            assert set(ms) == set(SPLIT)
            assert sum(ms.values()) == pytest.approx(wall * 1e3)
            assert min(ms["linear"], ms["head"], ms["attention"], ms["sampling"]) > 0 and ms["python"] >= 0
    assert worker.sampler is sampler and "compute_logits" not in vars(worker.model)
    assert not any("forward" in vars(m) for m in worker.model.modules()) and "prepare" not in vars(worker.runner)
    cost = model_cost(worker)
    config = worker.model.config
    assert cost.head_params == config.vocab_size * config.hidden_size
    assert cost.kv_bytes_per_token == 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 4


def test_engine_step_split_times_every_phase_and_takes_its_timers_off() -> None:
    from sarathi_rt import LLM, SamplingParams
    from sarathi_rt.harness.step_split import ENGINE_PHASES, StepSplit

    llm = LLM("tiny", num_kv_blocks=64, max_num_seqs=8, token_budget=64)
    engine = llm.engine
    worker = engine.executor.worker  # type: ignore[attr-defined]
    for i in range(4):
        engine.add_request(i, [5 + i, 6, 7], SamplingParams(max_tokens=6, ignore_eos=True))
    engine.step()  # the prefills
    with StepSplit(worker, engine) as split:
        start = time.perf_counter()
        for _ in range(3):
            engine.step()
        wall = time.perf_counter() - start
    ms = split.ms(wall)
    assert set(ms) == {*ENGINE_PHASES, "python"}
    assert sum(ms.values()) == pytest.approx(wall * 1e3)
    assert min(ms[k] for k in ENGINE_PHASES) > 0 and ms["python"] >= 0
    for owner in (engine, engine.scheduler, worker, worker.runner, worker.model):
        assert not {"_step_input", "_process", "schedule", "update", "prepare", "compute_logits",
                    "forward"} & set(vars(owner))
    assert not any("forward" in vars(m) for m in worker.model.modules())
    assert type(worker.sampler).__name__ == "Sampler"
    while engine.has_unfinished():  # the engine runs on untimed
        engine.step()
