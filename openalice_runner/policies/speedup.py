"""Expected gain of speculative decoding under the i.i.d. acceptance model.

With per-token acceptance rate α, γ draft tokens per round, c the cost of one draft step relative
to a one-row target pass, and r(n) the cost of a target pass of n rows relative to a one-row pass:
    tokens per round  = (1 − α^(γ+1)) / (1 − α)
    expected speedup  = tokens per round / (γ·c + r(γ+1))
r comes from the machine's measured pass costs (`pass_costs`: rows -> ratio, as a provider reports
them in `SpeculationOutcome.pass_cost_ratios`); without figures r ≡ 1, a verify pass priced as one
step whatever its rows, e.g. α = 0.75, γ = 4, c = 0.15 → 3.05 tokens per round, 1.91×.
On a CPU a pass of γ+1 rows costs more than one row (here about 1.3× at γ 4), so γ's best is smaller.
"""

from __future__ import annotations

from collections.abc import Mapping

PassCosts = Mapping[int, float]  # rows -> cost(rows) / cost(1 row), the rows that were measured


def tokens_per_round(alpha: float, gamma: int) -> float:
    if gamma <= 0:
        return 1.0
    if alpha >= 1.0:
        return float(gamma + 1)  # the limit of the geometric sum
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def pass_cost(pass_costs: PassCosts | None, rows: int) -> float:
    """r(rows): a pass of `rows` rows relative to a one-row pass, as engine/cost_model.py answers it:
    the nearest measured row count at or above `rows`; beyond the largest measured, growing
    linearly with the rows (assuming it flat would make a γ never measured look free); 1 without
    figures for passes of more than one row."""
    costs = pass_costs or {}
    longer = [r for r in costs if r > 1]
    if rows <= 1 or not longer:
        return 1.0
    above = [r for r in longer if r >= rows]
    if above:
        return costs[min(above)]
    largest = max(longer)
    return costs[largest] * rows / largest


def expected_speedup(alpha: float, gamma: int, draft_cost: float, pass_costs: PassCosts | None = None) -> float:
    return tokens_per_round(alpha, gamma) / (gamma * draft_cost + pass_cost(pass_costs, gamma + 1))


def best_gamma(
    alpha: float, draft_cost: float, lo: int, hi: int, pass_costs: PassCosts | None = None
) -> tuple[int, float]:
    """γ in [lo, hi] with the highest expected speedup (the smallest such γ on ties)."""
    best, best_s = lo, expected_speedup(alpha, lo, draft_cost, pass_costs)
    for g in range(lo + 1, hi + 1):
        s = expected_speedup(alpha, g, draft_cost, pass_costs)
        if s > best_s + 1e-12:
            best, best_s = g, s
    return best, best_s
