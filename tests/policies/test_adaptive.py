"""Speedup formula and adaptive γ: α/c estimates, choice of γ, off with margin, deterministic probing."""

from __future__ import annotations

import pytest

from openalice_runner.engine.types import SpecConfig
from openalice_runner.policies import AdaptiveGamma, PolicyStore, RequestContext
from openalice_runner.policies.adaptive import request_alpha, request_draft_cost
from openalice_runner.policies.schema import AdaptiveSettings
from openalice_runner.policies.speedup import best_gamma, expected_speedup, tokens_per_round
from openalice_runner.speculation import SpeculationOutcome


def test_brief_figures():
    assert round(tokens_per_round(0.75, 4), 2) == 3.05
    assert round(expected_speedup(0.75, 4, 0.15), 2) == 1.91


def test_edges():
    assert tokens_per_round(1.0, 4) == 5.0
    assert tokens_per_round(0.0, 4) == 1.0
    assert tokens_per_round(0.9, 0) == 1.0


def test_best_gamma_grows_with_alpha_and_shrinks_with_cost():
    g_lo_alpha, _ = best_gamma(0.6, 0.1, 1, 16)
    g_hi_alpha, _ = best_gamma(0.9, 0.1, 1, 16)
    assert g_hi_alpha > g_lo_alpha
    g_cheap, _ = best_gamma(0.8, 0.02, 1, 16)
    g_dear, _ = best_gamma(0.8, 0.3, 1, 16)
    assert g_cheap > g_dear
    assert best_gamma(0.99, 0.0, 2, 5)[0] == 5  # capped by the range


def stats(gamma: int, hist: list[int], draft_s=0.01, verify_s=0.1) -> SpeculationOutcome:
    rounds = sum(hist)
    accepted = sum(k * n for k, n in enumerate(hist))
    return SpeculationOutcome(
        method="ngram",
        gamma=gamma,
        proposed=rounds * gamma,
        accepted=accepted,
        accept_length_histogram=hist,
        draft_s=draft_s,
        verify_s=verify_s,
    )


def test_request_alpha_mle_and_fallbacks():
    # 4 rounds of γ=2: accepted 0,1,2,2 -> 5 accepted, 2 early stops -> 5/7
    assert request_alpha(stats(2, [1, 1, 2])) == pytest.approx(5 / 7)
    # rounds that proposed fewer than γ: falls back to accepted/proposed
    s = SpeculationOutcome(
        gamma=4,
        proposed=6,
        accepted=3,
        accept_length_histogram=[1, 0, 0, 1, 0],
    )
    assert request_alpha(s) == 0.5
    assert request_alpha(SpeculationOutcome(gamma=4)) is None  # nothing proposed: no evidence
    assert request_draft_cost(stats(4, [0, 0, 0, 0, 1], draft_s=0.02, verify_s=0.1)) == pytest.approx(0.05)
    assert request_draft_cost(SpeculationOutcome(gamma=4, verify_s=0.0)) is None


def test_request_alpha_leaves_probes_out():
    # 10 drafted, 4 of them probes that all failed: α is 6 of the 6 drafted in earnest
    mixed = SpeculationOutcome(gamma=5, proposed=10, accepted=6, probe_proposed=4, accept_length_histogram=[2, 0, 0, 2])
    assert request_alpha(mixed) == 1.0
    # a turn with nothing to copy: probes only, which say nothing about the turns that copy
    probes_only = SpeculationOutcome(gamma=5, proposed=6, accepted=0, probe_proposed=6, accept_length_histogram=[3])
    assert request_alpha(probes_only) is None


def test_request_alpha_on_adaptive_pools_comes_from_accepted_per_verify_round():
    # SGLang's adaptive EAGLE pool (largest candidate 5): 5 verify rounds accepted 0,1,1,1,1; SGLang
    # reports proposed = 5 × (launch num_draft_tokens 4 - 1) = 15, which is no count of what was drafted
    o = SpeculationOutcome(
        method="eagle", gamma=5, gamma_varies=True, proposed=15, accepted=4, target_passes=5,
        accept_length_histogram=(1, 4, 0, 0, 0, 0),
    )  # fmt: skip
    assert request_alpha(o) == pytest.approx(4 / (4 + 5))  # every round stopped early
    assert request_alpha(o) != pytest.approx(4 / 15)
    # rounds in the top bucket accepted all they could draft: no rejection in them
    full = SpeculationOutcome(gamma=3, gamma_varies=True, proposed=6, accepted=7, accept_length_histogram=(0, 1, 0, 2))
    assert request_alpha(full) == pytest.approx(7 / (7 + 1))
    # no histogram: accepted per verify round, every round one rejection
    bare = SpeculationOutcome(gamma=3, gamma_varies=True, proposed=30, accepted=10, target_passes=10)
    assert request_alpha(bare) == pytest.approx(10 / 20)
    # nothing accepted: the rounds may all have run 0 steps (large batch), so no evidence
    idle = SpeculationOutcome(gamma=3, gamma_varies=True, proposed=30, accepted=0, accept_length_histogram=(10,))
    assert request_alpha(idle) is None


def settings(**kw) -> AdaptiveSettings:
    base = {"ema_weight": 0.5, "warmup": 2, "margin": 0.05, "probe_every": 4}
    return AdaptiveSettings(**{**base, **kw})


def test_prior_until_warmup_then_measured_ema():
    a = AdaptiveGamma(settings())
    assert a.estimate("rag", "ngram", "local") == (0.5, 0.02, False)
    a.observe("rag", "ngram", "local", stats(4, [0, 0, 0, 0, 5]))  # every draft accepted: α 1.0
    assert a.estimate("rag", "ngram", "local")[2] is False  # 1 < warmup 2
    a.observe("rag", "ngram", "local", stats(4, [5, 0, 0, 0, 0]))  # nothing accepted: α 0
    alpha, cost, measured = a.estimate("rag", "ngram", "local")
    assert measured and alpha == pytest.approx(0.5)  # EMA weight 0.5: 0.5*1 + 0.5*0
    assert cost == pytest.approx(0.025)  # draft 0.01 / (4 * 0.1), measured
    assert a.estimate("chat", "ngram", "local")[2] is False  # keyed by turn type
    a.observe("rag", "off", "local", stats(4, [0, 0, 0, 0, 5]))  # off teaches nothing


def feed(a: AdaptiveGamma, turn: str, alpha_hist: list[int], gamma: int, n: int = 5, draft_s=0.01):
    for _ in range(n):
        a.observe(turn, "ngram", "local", stats(gamma, alpha_hist, draft_s=draft_s))


def test_auto_picks_larger_gamma_for_higher_alpha_and_lower_cost():
    a = AdaptiveGamma(settings())
    feed(a, "tool_call", [1, 1, 1, 1, 1, 20], 5)  # mostly accepted
    feed(a, "chat", [10, 5, 3, 1, 1, 1], 5)  # mostly rejected early
    hi = a.choose("tool_call", "ngram", "local", 1, 12)
    lo = a.choose("chat", "ngram", "local", 1, 12)
    assert hi.measured and lo.measured
    assert hi.gamma > lo.gamma > 0
    cheap = AdaptiveGamma(settings())
    dear = AdaptiveGamma(settings())
    feed(cheap, "rag", [1, 1, 1, 1, 1, 6], 5, draft_s=0.001)
    feed(dear, "rag", [1, 1, 1, 1, 1, 6], 5, draft_s=0.2)
    assert (
        cheap.choose("rag", "ngram", "local", 1, 12).gamma > dear.choose("rag", "ngram", "local", 1, 12).gamma
    )


def test_off_for_small_alpha_with_deterministic_probe():
    a = AdaptiveGamma(settings(probe_every=4))
    feed(a, "chat", [20, 1, 0, 0], 3)  # α ≈ 0.05
    choices = [a.choose("chat", "ngram", "local", 2, 8) for _ in range(8)]
    assert [c.gamma for c in choices] == [0, 0, 0, 2, 0, 0, 0, 2]  # every 4th probes with min_gamma
    assert choices[3].probe and "probe" in choices[3].describe()
    # copying resumes: the probes' figures lift α and speculation comes back
    feed(a, "chat", [0, 0, 0, 10], 3, n=6)
    assert a.choose("chat", "ngram", "local", 2, 8).gamma > 0


def test_margin_decides_off():
    # α 0.35, c 0.3: best expected speedup is about 1.04x, above 1.0 but below 1 + margin
    _, s = best_gamma(0.35, 0.3, 1, 8)
    assert 1.0 < s < 1.05
    a = AdaptiveGamma(
        settings(margin=0.05, prior_alpha={"ngram": 0.35}, prior_draft_cost={"ngram": 0.3}, probe_every=1000)
    )
    assert a.choose("chat", "ngram", None, 1, 8).gamma == 0
    a.configure(settings(margin=0.0, prior_alpha={"ngram": 0.35}, prior_draft_cost={"ngram": 0.3}))
    assert a.choose("chat", "ngram", None, 1, 8).gamma > 0


POLICY = """\
adaptive: {ema_weight: 0.5, warmup: 1, probe_every: 3}
rules:
  - name: small
    match: {batch_size: {max: 4}}
    method: ngram
    gamma: auto
    min_gamma: 1
    max_gamma: 10
  - name: mid
    match: {batch_size: {min: 5, max: 16}}
    method: ngram
    gamma: auto
    min_gamma: 1
    max_gamma: 3
default: {method: off}
"""


def test_store_decisions_follow_observations_and_batch_caps_gamma():
    store = PolicyStore.from_text(POLICY)
    store.observe("tool_call", "ngram", "local", stats(6, [0, 0, 0, 0, 0, 1, 9]))
    small = store.decide(RequestContext("tool_call", 1, "local"))
    mid = store.decide(RequestContext("tool_call", 8, "local"))
    assert small.gamma > 3 and mid.gamma == 3  # the mid-batch rule caps γ
    assert "measured" in small.reason and small.rule == "small"
    store.observe("chat", "ngram", "local", stats(6, [30, 1, 0, 0, 0, 0, 0]))
    d = store.decide(RequestContext("chat", 1, "local"))
    assert d.method == "off" and d.gamma == 0 and d.rule == "small"
    assert not d.speculates and SpecConfig.from_plan(d).method == "off"


def test_observe_never_raises():
    store = PolicyStore.from_text(POLICY)
    store.observe("chat", "ngram", "local", object())  # not stats at all
    store.observe("chat", "ngram", "local", None)
