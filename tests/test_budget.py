"""Token budget from a TBT SLO: known answers on a linear step-time model."""
from __future__ import annotations

import pytest

from sarathi_rt.sim.budget import StepTimeCurve, SyntheticRow, choose_token_budget, cost_model_curve, hybrid_batch
from sarathi_rt.scheduler import BatchPlan, PlanEntry
from sarathi_rt.sim import LinearCostModel, VidurCostModel
from sarathi_rt.workloads import data_path


def _linear_profile() -> StepTimeCurve:
    # T(n) = 10 ms + 0.1 ms per token
    return cost_model_curve(LinearCostModel(0.01, 1e-4), list(range(32, 2049, 32)), num_decodes=16,
                              context_len=256)


def test_profile_of_a_cost_model_is_exact() -> None:
    p = _linear_profile()
    assert p.num_tokens[0] == 32 and p.seconds[0] == pytest.approx(0.0132)
    assert p.step_time(1000) == pytest.approx(0.11)


def test_choose_token_budget_known_answer() -> None:
    p = _linear_profile()
    # Limit 0.1 * 0.9 = 0.09 s -> n <= 800 -> largest multiple of 128 is 768.
    choice = choose_token_budget(p, 0.1, 128)
    assert (choice.token_budget, choice.tile_size) == (768, 128)
    assert choice.step_time == pytest.approx(0.0868)
    assert choose_token_budget(p, 0.1, 64, margin=0.0).token_budget == 896
    assert choose_token_budget(p, 10.0, 128).token_budget == 2048  # capped at the largest measured count


def test_budget_stops_at_the_first_miss() -> None:
    noisy = StepTimeCurve((128, 256, 384, 512), (0.05, 0.2, 0.05, 0.05), 0, 1)
    assert choose_token_budget(noisy, 0.1, 128).token_budget == 128


def test_unreachable_slo_and_bad_arguments() -> None:
    p = _linear_profile()
    with pytest.raises(ValueError, match="out of reach"):
        choose_token_budget(p, 0.01, 128)
    with pytest.raises(ValueError, match="tbt_slo"):
        choose_token_budget(p, -1.0, 128)
    with pytest.raises(ValueError, match="tile_size"):
        choose_token_budget(p, 0.1, 0)
    with pytest.raises(ValueError, match="margin"):
        choose_token_budget(p, 0.1, 128, margin=1.0)
    with pytest.raises(ValueError, match="token_counts"):
        cost_model_curve(LinearCostModel(), [0, 5])
    with pytest.raises(ValueError, match="increasing"):
        StepTimeCurve((5, 3), (1.0, 1.0), 0, 1)


def test_hybrid_batch_shape() -> None:
    decode, chunk = SyntheticRow(100, 1, False, True), SyntheticRow(100, 6, True, False)
    assert hybrid_batch(10, 4, 100) == [decode] * 4 + [chunk]
    assert hybrid_batch(3, 4, 100) == [decode] * 3


def test_profile_round_trip_and_cost_model(tmp_path) -> None:
    p = cost_model_curve(VidurCostModel(data_path("a100_llama-2-7b_mlp.csv.gz")), [64, 128, 512, 1024],
                           num_decodes=32, context_len=1024, label="a100")
    assert all(a < b for a, b in zip(p.seconds, p.seconds[1:]))
    p.save(tmp_path / "p.json")
    assert StepTimeCurve.load(tmp_path / "p.json") == p
    plan = BatchPlan(1, [PlanEntry(0, 0, 512, True, True)], num_prefill_tokens=512)
    assert p.cost_model().step_time(plan) == p.seconds[2]
