"""Rule-set analysis: unreachable rules and ambiguous overlaps.

Rules are tried top to bottom and the first match decides. Two mistakes are reported:

* **Unreachable rule**: every context the rule matches is already matched by earlier rules
  (alone or together), so it can never decide. Computed exactly, over "atoms": each condition's
  domain is cut into the names the rules mention plus "any other name", and batch sizes into the
  intervals between all range bounds; a rule is reachable iff some atom reaches it first.
* **Overlapping rules**: an earlier rule A and a later rule B can match the same context, they
  decide differently (method, γ, γ range, options or pool), and A is not narrower than B on every
  condition. If A ⊆ B, A is a deliberate exception listed before the general rule B: allowed.
  Otherwise which rule wins depends only on the order, so the file must say what it means:
  narrow one of the rules so they no longer meet, or make A an exception (A ⊆ B).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from openalice_runner.config_files.errors import Problem
from openalice_runner.config_files.yaml_nodes import Located
from openalice_runner.policies.schema import Match, Rule

_OTHER = "\x00other"  # stands for every name no rule mentions
_MAX_ATOMS = 200_000  # beyond this, fall back to pairwise coverage (rule sets that large are unheard of)
_NAME_FIELDS = ("turn_type", "provider", "model")


@dataclass(frozen=True)
class MatchSet:
    """A rule's match as sets: None means any value; batch is the inclusive [lo, hi]."""

    turn_type: frozenset[str] | None
    provider: frozenset[str] | None
    model: frozenset[str] | None
    batch_lo: int
    batch_hi: float  # math.inf when unbounded

    @classmethod
    def of(cls, match: Match) -> MatchSet:
        def names(v: str | list[str] | None) -> frozenset[str] | None:
            return None if v is None else frozenset([v] if isinstance(v, str) else v)

        b = match.batch_size
        return cls(
            names(match.turn_type),
            names(match.provider),
            names(match.model),
            b.min if b else 1,
            (b.max if b and b.max is not None else math.inf),
        )

    def intersects(self, o: MatchSet) -> bool:
        return (
            all(_names_meet(getattr(self, f), getattr(o, f)) for f in _NAME_FIELDS)
            and self.batch_lo <= o.batch_hi
            and o.batch_lo <= self.batch_hi
        )

    def within(self, o: MatchSet) -> bool:
        """Every context self matches, o matches too."""
        for f in _NAME_FIELDS:
            mine, theirs = getattr(self, f), getattr(o, f)
            if theirs is not None and (mine is None or not mine <= theirs):
                return False
        return o.batch_lo <= self.batch_lo and self.batch_hi <= o.batch_hi

    def matches_atom(self, turn: str, provider: str, model: str, batch: int) -> bool:
        return (
            (self.turn_type is None or turn in self.turn_type)
            and (self.provider is None or provider in self.provider)
            and (self.model is None or model in self.model)
            and self.batch_lo <= batch <= self.batch_hi
        )

    def common(self, o: MatchSet) -> str:
        """A short description of contexts both match, for error messages."""
        parts = []
        for f in _NAME_FIELDS:
            a, b = getattr(self, f), getattr(o, f)
            both = a & b if a is not None and b is not None else (a if a is not None else b)
            if both is not None:
                parts.append(f"{f}={'|'.join(sorted(both))}")
        lo, hi = max(self.batch_lo, o.batch_lo), min(self.batch_hi, o.batch_hi)
        if (lo, hi) != (1, math.inf):
            parts.append(f"batch_size={lo}..{'' if hi == math.inf else int(hi)}")
        return ", ".join(parts) or "every context"


def _names_meet(a: frozenset[str] | None, b: frozenset[str] | None) -> bool:
    return a is None or b is None or bool(a & b)


def decision_key(rule: Rule) -> tuple:
    return (rule.method, rule.gamma, rule.gamma_bounds, rule.options, rule.pool)


def analyse_rules(rules: list[Rule], loc: Located) -> list[Problem]:
    sets = [MatchSet.of(r.match) for r in rules]
    # a rule with an empty batch range is already reported by checks.py
    unreachable = {j for j in _unreachable(sets) if sets[j].batch_lo <= sets[j].batch_hi}
    problems: list[Problem] = []
    for j in sorted(unreachable):
        covering = [
            f"{rules[i].name!r} (line {loc.where(('rules', i))[0]})"
            for i in range(j)
            if sets[i].intersects(sets[j])
        ]
        problems.append(
            loc.problem(
                ("rules", j, "match"),
                f"rule {rules[j].name!r} is unreachable: earlier rules {', '.join(covering)} already match everything it matches",
            )
        )
    for j, b in enumerate(sets):
        if j in unreachable:
            continue
        for i in range(j):
            a = sets[i]
            if a.intersects(b) and not a.within(b) and decision_key(rules[i]) != decision_key(rules[j]):
                problems.append(
                    loc.problem(
                        ("rules", j, "match"),
                        f"rule {rules[j].name!r} overlaps earlier rule {rules[i].name!r} (line {loc.where(('rules', i))[0]}) "
                        f"on {a.common(b)} with a different decision; the order alone would decide. "
                        f"Narrow one of them, or make the earlier one a strict exception (all its conditions within this one's)",
                    )
                )
    return problems


def _unreachable(sets: list[MatchSet]) -> set[int]:
    axes = []
    for f in _NAME_FIELDS:
        named = set().union(*(getattr(s, f) or () for s in sets))
        axes.append(sorted(named) + [_OTHER])
    bounds = {1}
    for s in sets:
        bounds.add(s.batch_lo)
        if s.batch_hi != math.inf:
            bounds.add(int(s.batch_hi) + 1)
    batches = sorted(bounds)  # each interval [b_k, b_{k+1}) is one atom; its start represents it
    n_atoms = math.prod(len(a) for a in axes) * len(batches)
    if n_atoms > _MAX_ATOMS:
        return {j for j, b in enumerate(sets) if any(b.within(sets[i]) for i in range(j))}
    reached: set[int] = set()
    for turn, provider, model in itertools.product(*axes):
        # rules whose name conditions hold for this atom, in order; batch decides among them
        candidates = [k for k, s in enumerate(sets) if s.matches_atom(turn, provider, model, s.batch_lo)]
        for batch in batches:
            for k in candidates:
                if sets[k].matches_atom(turn, provider, model, batch):
                    reached.add(k)
                    break
    return set(range(len(sets))) - reached
