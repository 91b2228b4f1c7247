"""Adaptive γ: learn α and c from finished requests, pick the γ with the best expected speedup.

Estimates
* α per (turn type, method, provider): an exponential moving average (weight `ema_weight` for the
  newest request) of each request's acceptance. Per request we use the truncated-geometric MLE from
  the accept-length histogram, α̂ = accepted / (accepted + rounds that stopped early); it is unbiased
  for the model the speedup formula assumes, where plain accepted/proposed underestimates α.
  Until `warmup` requests have been seen the method's prior α is used instead.
* c per (method, provider): EMA of draft_s / (γ · verify_s), the time of one draft step over the time
  of one verify pass. Draft cost belongs to the drafter and the hardware, not to the turn type, so it is
  pooled over turn types; the prior c is used until the first measurement.

Choice: the γ in the rule's [min_gamma, max_gamma] (which the rule's batch range bounds: operators give
big-batch rules smaller ranges) that maximises expected speedup; `off` if even that is below
1 + margin. While a key sits at `off`, every `probe_every`-th decision for it speculates with min_gamma
anyway (a counter per key, so probing is deterministic and testable) to notice when a turn type
starts copying again.

Concurrency: `observe` takes a lock and publishes a new immutable snapshot (copy-on-write);
`choose` only reads the current snapshot reference, so deciding never waits for a lock.
"""

from __future__ import annotations

import itertools
import math
import threading
from dataclasses import dataclass

from openalice_runner.policies.schema import AdaptiveSettings
from openalice_runner.policies.speedup import best_gamma
from openalice_runner.speculation import SpeculationOutcome

AlphaKey = tuple[str, str, str | None]  # (turn_type, method, provider)
# Turn types are the client's (a header): the α estimates and probe counters keep at most this many
# keys, the least recently observed going first (a flood of made-up turn types cannot grow them).
MAX_KEYS = 1024
CostKey = tuple[str, str | None]  # (method, provider)


@dataclass(frozen=True)
class Estimate:
    value: float
    count: int  # requests that contributed


@dataclass(frozen=True)
class Choice:
    gamma: int  # 0 = off
    alpha: float
    draft_cost: float
    speedup: float
    measured: bool  # False while the prior is used
    probe: bool = False

    def describe(self) -> str:
        src = "measured" if self.measured else "prior"
        what = f"gamma {self.gamma}" if self.gamma else "off"
        tag = "probe with " if self.probe else ""
        return f"auto: {tag}{what} (alpha {self.alpha:.2f} {src}, c {self.draft_cost:.3f}, expected {self.speedup:.2f}x)"


def request_alpha(outcome: SpeculationOutcome) -> float | None:
    """Per-token acceptance of one request, or None when it proposed nothing but probes.

    Probes (drafts the drafter itself expected to lose, sent to re-measure) are left out: a
    self-gating drafter such as n-gram drafts in earnest only where it expects a gain, so a turn
    with nothing to copy proposes probes only, and must not teach the policy that this turn
    type never copies. (It did: three prose answers to a tool call turned n-gram off for the
    next tool-call turns, which copied.)"""
    if outcome.gamma_varies:
        return _varying_gamma_alpha(outcome)
    probes = outcome.probe_proposed
    proposed = outcome.proposed - probes
    if proposed <= 0:
        return None
    if probes:
        accepted = outcome.accepted - outcome.probe_accepted
        return min(1.0, max(0.0, accepted / proposed))
    hist = outcome.accept_length_histogram
    gamma = outcome.gamma
    # The MLE needs every round to have proposed the full γ (n-gram rounds may propose fewer: then a
    # short round that accepted all it proposed is not a rejection, and we fall back to accepted/proposed).
    if len(hist) == gamma + 1 >= 2 and sum(hist) * gamma == proposed:
        accepted = sum(k * n for k, n in enumerate(hist))
        # rounds that accepted every draft (the last bucket) ended without a rejection
        early_stops = sum(hist[:-1])
        if accepted + early_stops > 0:
            return accepted / (accepted + early_stops)
    return min(1.0, max(0.0, outcome.accepted / proposed))


def _varying_gamma_alpha(outcome: SpeculationOutcome) -> float | None:
    """α when a round drafts a number of tokens that varies per round (SGLang's adaptive EAGLE
    pools run 0..max steps as the batch changes, and report proposed drafts against the launch
    step count, which is no count of what was drafted). From accepted drafts per verify round:
    with k accepted in a round, a round that accepted fewer than the most it could draft (`gamma`,
    the largest candidate step) counts as one rejection, so α̂ = accepted / (accepted + rounds that
    stopped early). A round that drafted fewer steps and accepted them all counts as a rejection,
    so this errs low; with no histogram every round counts as one (accepted / (accepted + rounds)).
    A request that accepted nothing tells nothing: its rounds may all have run 0 steps."""
    hist = outcome.accept_length_histogram
    if hist:
        rounds = sum(hist)
        accepted = sum(k * n for k, n in enumerate(hist))
        full = hist[outcome.gamma] if 0 < outcome.gamma == len(hist) - 1 else 0
    else:
        rounds = outcome.target_passes
        accepted = outcome.accepted
        full = 0
    if rounds <= 0 or accepted <= 0:
        return None
    return accepted / (accepted + rounds - full)


def request_draft_cost(outcome: SpeculationOutcome) -> float | None:
    gamma = outcome.gamma
    draft_s = outcome.draft_s or 0.0
    verify_s = outcome.verify_s or 0.0
    if gamma <= 0 or verify_s <= 0.0 or draft_s < 0.0:
        return None
    c = draft_s / (gamma * verify_s)
    return c if math.isfinite(c) else None


class AdaptiveGamma:
    def __init__(self, settings: AdaptiveSettings | None = None):
        self.settings = settings or AdaptiveSettings()
        self.version = 0  # bumped whenever what `peek` answers may change (caches key on it)
        self._lock = threading.Lock()
        self._alpha: dict[AlphaKey, Estimate] = {}  # replaced, never mutated
        self._cost: dict[CostKey, Estimate] = {}
        self._off_counters: dict[AlphaKey, itertools.count] = {}

    def configure(self, settings: AdaptiveSettings) -> None:
        """New knobs from a reloaded policy; measured estimates are kept (they describe the workload)."""
        self.settings = settings
        self.version += 1

    # ---- writes (lock) ----
    def observe(self, turn_type: str, method: str, provider: str | None, outcome: SpeculationOutcome) -> None:
        if method == "off":
            return
        alpha = request_alpha(outcome)
        cost = request_draft_cost(outcome)
        w = self.settings.ema_weight
        with self._lock:
            if alpha is not None:
                key = (turn_type, method, provider)
                self._alpha = _bounded_put(self._alpha, key, _ema(self._alpha.get(key), alpha, w))
            if cost is not None:
                ckey = (method, provider)
                self._cost = {**self._cost, ckey: _ema(self._cost.get(ckey), cost, w)}
            self.version += 1

    def reset(self) -> None:
        with self._lock:
            self._alpha, self._cost, self._off_counters = {}, {}, {}
            self.version += 1

    # ---- reads (no lock) ----
    def estimate(
        self, turn_type: str, method: str, provider: str | None, prior_alpha: float | None = None
    ) -> tuple[float, float, bool]:
        """(α, c, measured) as `choose` would use them now."""
        s = self.settings
        est = self._alpha.get((turn_type, method, provider))
        measured = est is not None and est.count >= s.warmup
        if est is not None and measured:
            alpha = est.value
        else:
            alpha = prior_alpha if prior_alpha is not None else getattr(s.prior_alpha, method)
        cost_est = self._cost.get((method, provider))
        cost = cost_est.value if cost_est is not None else getattr(s.prior_draft_cost, method)
        return alpha, cost, measured

    def choose(
        self,
        turn_type: str,
        method: str,
        provider: str | None,
        lo: int,
        hi: int,
        prior_alpha: float | None = None,
    ) -> Choice:
        alpha, cost, measured = self.estimate(turn_type, method, provider, prior_alpha)
        gamma, speedup = self._paying_gamma(alpha, cost, lo, hi)
        if gamma:
            return Choice(gamma, alpha, cost, speedup, measured)
        key = (turn_type, method, provider)
        counter = self._off_counters.get(key)
        if counter is None:
            if len(self._off_counters) >= MAX_KEYS:  # turn types are clients': the oldest key goes
                with self._lock:
                    for old in list(self._off_counters)[: len(self._off_counters) - MAX_KEYS + 1]:
                        self._off_counters.pop(old, None)
            counter = self._off_counters.setdefault(key, itertools.count(1))  # setdefault: atomic
        if next(counter) % self.settings.probe_every == 0:
            return Choice(lo, alpha, cost, best_gamma(alpha, cost, lo, lo)[1], measured, probe=True)
        return Choice(0, alpha, cost, 1.0, measured)

    def peek(
        self,
        turn_type: str,
        method: str,
        provider: str | None,
        lo: int,
        hi: int,
        prior_alpha: float | None = None,
    ) -> int:
        """γ `choose` would pick now, without probing or counting (0: off)."""
        alpha, cost, _ = self.estimate(turn_type, method, provider, prior_alpha)
        return self._paying_gamma(alpha, cost, lo, hi)[0]

    def _paying_gamma(self, alpha: float, cost: float, lo: int, hi: int) -> tuple[int, float]:
        """(best γ in [lo, hi], its expected speedup); γ 0 when that speedup is under the margin."""
        gamma, speedup = best_gamma(alpha, cost, lo, hi)
        return (gamma, speedup) if speedup >= 1.0 + self.settings.margin else (0, speedup)

    def snapshot(self) -> dict:
        """Current estimates, for `policy explain` and debugging."""
        return {
            "alpha": {"/".join(str(p) for p in k): vars(v) for k, v in self._alpha.items()},
            "draft_cost": {"/".join(str(p) for p in k): vars(v) for k, v in self._cost.items()},
        }


def _bounded_put(table: dict[AlphaKey, Estimate], key: AlphaKey, value: Estimate) -> dict[AlphaKey, Estimate]:
    """A copy of `table` with `key` set last; past MAX_KEYS the keys least recently observed go."""
    out = dict(table)
    out.pop(key, None)
    out[key] = value
    while len(out) > MAX_KEYS:
        del out[next(iter(out))]
    return out


def _ema(old: Estimate | None, x: float, w: float) -> Estimate:
    if old is None:
        return Estimate(x, 1)
    return Estimate((1.0 - w) * old.value + w * x, old.count + 1)
