"""The verify pass priced by its rows (issue 49): the speed-up model with a machine's measured pass
costs, and adaptive γ learning them from outcomes."""

from __future__ import annotations

import pytest

from openalice_runner.policies import AdaptiveGamma
from openalice_runner.policies.adaptive import request_draft_cost
from openalice_runner.policies.schema import AdaptiveSettings
from openalice_runner.policies.speedup import best_gamma, expected_speedup, pass_cost
from openalice_runner.speculation import SpeculationOutcome

MEASURED = {1: 1.0, 2: 1.1, 3: 1.2, 5: 1.3}  # rows -> cost(rows) / cost(1 row)
# a CPU's verify passes: each row 6% of a one-row pass more (7 rows: 1.36 steps)
CPU = {n: 1.0 + 0.06 * (n - 1) for n in range(1, 14)}


def test_the_speedup_prices_the_verify_pass_by_its_measured_rows():
    # α 0.75, c 0.15 (a draft step over a one-row pass)
    # γ 4: 5 rows measured, 1.3 -> (1 − 0.75^5)/0.25 = 3.05078125 tokens / (4·0.15 + 1.3)
    assert expected_speedup(0.75, 4, 0.15, MEASURED) == pytest.approx(3.05078125 / 1.9)
    # γ 2: 3 rows, 1.2 -> 2.3125 / (0.3 + 1.2)
    assert expected_speedup(0.75, 2, 0.15, MEASURED) == pytest.approx(2.3125 / 1.5)
    # γ 3: 4 rows not measured, the nearest measured above (5 rows) answers, as the engine's model does
    assert pass_cost(MEASURED, 4) == 1.3
    # γ 7: 8 rows, past the largest measured: linear from 5 rows, 1.3 · 8/5 = 2.08
    assert expected_speedup(0.75, 7, 0.15, MEASURED) == pytest.approx((1 - 0.75**8) / 0.25 / (1.05 + 2.08))
    assert pass_cost(MEASURED, 1) == 1.0 and expected_speedup(0.75, 0, 0.15, MEASURED) == 1.0


def test_without_figures_a_verify_pass_is_one_step_as_before():
    flat = 3.05078125 / (4 * 0.15 + 1.0)
    assert expected_speedup(0.75, 4, 0.15) == pytest.approx(flat)
    assert expected_speedup(0.75, 4, 0.15, None) == expected_speedup(0.75, 4, 0.15, {}) == expected_speedup(0.75, 4, 0.15)
    # a one-row figure alone says nothing of longer passes: flat, not extrapolated from 1 row
    assert expected_speedup(0.75, 4, 0.15, {1: 1.0}) == expected_speedup(0.75, 4, 0.15)
    assert best_gamma(0.8, 0.02, 1, 12, None) == best_gamma(0.8, 0.02, 1, 12)


def outcome(pass_costs=None, hist=(4, 3, 2, 2, 1, 8)) -> SpeculationOutcome:
    """γ 5 rounds, α about 0.83; one draft step is 0.01 / 5 / 0.1 = 0.02 of the verify pass."""
    return SpeculationOutcome(
        method="ngram", gamma=5, proposed=sum(hist) * 5, accepted=sum(k * n for k, n in enumerate(hist)),
        accept_length_histogram=hist, draft_s=0.01, verify_s=0.1, pass_cost_ratios=pass_costs,
    )  # fmt: skip


def learned(pass_costs) -> AdaptiveGamma:
    a = AdaptiveGamma(AdaptiveSettings(ema_weight=0.5, warmup=2, margin=0.05, probe_every=4))
    for _ in range(3):
        a.observe("tool_result", "ngram", "local", outcome(pass_costs))
    return a


def test_adaptive_picks_a_smaller_gamma_where_verify_rows_cost_more():
    flat, cpu = learned(None), learned(CPU)
    alpha, c, measured = flat.estimate("tool_result", "ngram", "local")
    assert measured and c == pytest.approx(0.02)
    # no figures: today's γ, from today's formula
    today = best_gamma(alpha, c, 1, 12)[0]
    assert flat.choose("tool_result", "ngram", "local", 1, 12).gamma == today == 12
    assert flat.pass_costs("ngram", "local") is None
    # figures: the draft step in one-row passes (0.02 of a 6-row verify pass, which is 1.3 steps)
    # and a γ priced by its verify rows: smaller
    _, c1, _ = cpu.estimate("tool_result", "ngram", "local")
    assert c1 == pytest.approx(0.02 * 1.3)
    choice = cpu.choose("tool_result", "ngram", "local", 1, 12)
    assert choice.gamma == best_gamma(alpha, c1, 1, 12, CPU)[0] < today
    assert choice.verify_cost == pytest.approx(CPU[choice.gamma + 1]) and "verify" in choice.describe()
    assert cpu.peek("tool_result", "ngram", "local", 1, 12) == choice.gamma
    assert cpu.snapshot()["pass_cost_ratios"] == {"ngram/local": CPU}


def test_the_newest_figures_count_and_an_outcome_without_them_keeps_them():
    a = learned(CPU)
    steeper = {n: 1.0 + 0.2 * (n - 1) for n in range(1, 14)}
    a.observe("tool_result", "ngram", "local", outcome(steeper))
    assert a.pass_costs("ngram", "local") == steeper
    a.observe("tool_result", "ngram", "local", outcome(None))  # e.g. an engine that has not timed a pass
    assert a.pass_costs("ngram", "local") == steeper
    assert a.pass_costs("ngram", "pool") is None  # per (method, provider)
    # figures that are no ratios are left out rather than learned
    assert request_draft_cost(outcome({1: 1.0, 6: float("nan")})) == pytest.approx(0.02)
