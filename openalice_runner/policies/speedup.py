"""Expected gain of speculative decoding under the i.i.d. acceptance model.

With per-token acceptance rate α, γ draft tokens per round and c the cost of one draft step relative
to one target pass:
    tokens per round  = (1 − α^(γ+1)) / (1 − α)
    expected speedup  = tokens per round / (γ·c + 1)
e.g. α = 0.75, γ = 4, c = 0.15 → 3.05 tokens per round, 1.91×.
"""

from __future__ import annotations


def tokens_per_round(alpha: float, gamma: int) -> float:
    if gamma <= 0:
        return 1.0
    if alpha >= 1.0:
        return float(gamma + 1)  # the limit of the geometric sum
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def expected_speedup(alpha: float, gamma: int, draft_cost: float) -> float:
    return tokens_per_round(alpha, gamma) / (gamma * draft_cost + 1.0)


def best_gamma(alpha: float, draft_cost: float, lo: int, hi: int) -> tuple[int, float]:
    """γ in [lo, hi] with the highest expected speedup (the smallest such γ on ties)."""
    best, best_s = lo, expected_speedup(alpha, lo, draft_cost)
    for g in range(lo + 1, hi + 1):
        s = expected_speedup(alpha, g, draft_cost)
        if s > best_s + 1e-12:
            best, best_s = g, s
    return best, best_s
