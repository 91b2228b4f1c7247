"""Planning: a request's context -> a SpeculationPlan (method and γ), by the first matching rule of a
compiled policy.

Compilation turns each rule into plain sets and ints once, at load time, so deciding a plan is a short
loop of set lookups and comparisons (a few µs); rules with a fixed γ have their reason text prebuilt.
A plan also carries γ by batch size for its method (`per_batch`): the rules that match the
request but for its batch size, cut into batch pieces (`batch_table.py`), so a batching engine
follows the policy step by step from data instead of calling back into it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from openalice_runner.policies.adaptive import AdaptiveGamma
from openalice_runner.policies.batch_table import batch_segments
from openalice_runner.policies.bounded import BoundedCache
from openalice_runner.policies.schema import PlanSpec, Policy
from openalice_runner.speculation import GammaTable, SpecMethod, SpeculationPlan

_INF = float("inf")


@dataclass(frozen=True, slots=True)
class RequestContext:
    turn_type: str = "chat"
    # None: the provider reads its servers' load and could read none ("unknown", never batch 1)
    batch_size: int | None = 1
    provider: str | None = None  # provider or SGLang pool name the request will go to
    model: str | None = None
    tenant: str | None = None  # whose request: adaptive γ learns per tenant (PolicyStore)


@dataclass(frozen=True, slots=True)
class CompiledRule:
    name: str
    turn_types: frozenset[str] | None
    providers: frozenset[str] | None
    models: frozenset[str] | None
    batch_lo: int
    batch_hi: float
    batch_any: bool  # no batch_size condition: matches an unknown batch size too
    batch_unknown: bool  # batch_size.unknown: true
    method: SpecMethod
    auto: bool
    gamma_lo: int
    gamma_hi: int
    pool: str | None
    options: dict[str, Any]
    prior_alpha: float | None
    fixed: SpeculationPlan | None  # prebuilt when γ is fixed (or off)
    where: str  # e.g. "rule 'copy' (#1)", for reasons


def _names(v: str | list[str] | None) -> frozenset[str] | None:
    return None if v is None else frozenset([v] if isinstance(v, str) else v)


def _compile_one(spec: PlanSpec, name: str, where: str, version: str, match: Any | None) -> CompiledRule:
    lo, hi = spec.gamma_bounds
    options = {k: v for k, v in spec.options.model_dump().items() if v is not None}
    auto = spec.auto and spec.method != "off"
    fixed = None
    if not auto:
        text = f"{where}: {spec.method}" + (f" gamma {lo}" if spec.method != "off" else "")
        fixed = SpeculationPlan(spec.method, lo, name, text, version, spec.pool, options)
    b = match.batch_size if match is not None else None
    return CompiledRule(
        name=name,
        turn_types=_names(match.turn_type) if match is not None else None,
        providers=_names(match.provider) if match is not None else None,
        models=_names(match.model) if match is not None else None,
        batch_lo=b.min if b else 1,
        batch_hi=(b.max if b and b.max is not None else _INF),
        batch_any=b is None,
        batch_unknown=bool(b and b.unknown),
        method=spec.method,
        auto=auto,
        gamma_lo=lo,
        gamma_hi=hi,
        pool=spec.pool,
        options=options,
        prior_alpha=spec.prior_alpha,
        fixed=fixed,
        where=where,
    )


class CompiledPolicy:
    """A validated policy in plan-ready form. Immutable; swapped whole on reload."""

    __slots__ = ("policy", "version", "rules", "default", "_pieces", "_tables", "_named")

    def __init__(self, policy: Policy, version: str):
        self.policy = policy
        self.version = version
        self.rules: tuple[CompiledRule, ...] = tuple(
            _compile_one(r, r.name, f"rule {r.name!r} (#{i})", version, r.match)
            for i, r in enumerate(policy.rules)
        )
        self.default = _compile_one(policy.default, "default", "no rule matched, default", version, None)
        # The turn types, providers and models some rule names: any other name matches exactly as
        # None does, so the caches below key it as None (a client's made-up names share one entry).
        self._named = tuple(
            frozenset().union(*(getattr(r, field) or () for r in self.rules))
            for field in ("turn_types", "providers", "models")
        )
        # (turn type, provider, model) -> batch pieces and their first matching rule; the policy is
        # immutable, so a racing duplicate write stores the same value. Bounded: the names are clients'.
        self._pieces: BoundedCache[list[tuple[int, CompiledRule]]] = BoundedCache()
        # tables as last built, with the estimates they were built from (auto pieces read them); keyed
        # by the turn type as sent, whose α estimates the auto pieces read
        self._tables: BoundedCache[tuple[AdaptiveGamma, int, GammaTable | None]] = BoundedCache()

    def match(self, ctx: RequestContext) -> CompiledRule:
        turn, batch, provider, model = ctx.turn_type, ctx.batch_size, ctx.provider, ctx.model
        if batch is None:
            return self._match_unknown(ctx)
        for r in self.rules:
            if (
                (r.turn_types is None or turn in r.turn_types)
                and r.batch_lo <= batch <= r.batch_hi
                and (r.providers is None or provider in r.providers)
                and (r.models is None or model in r.models)
            ):
                return r
        return self.default

    def _match_unknown(self, ctx: RequestContext) -> CompiledRule:
        """Batch size unknown: the first rule that matches it (no batch_size condition, or
        `batch_size: {unknown: true}`); else the rule the request meets at the largest batch
        sizes, the most conservative (speculation pays least there)."""
        turn, provider, model = ctx.turn_type, ctx.provider, ctx.model
        for r in self.rules:
            if (
                (r.batch_any or r.batch_unknown)
                and (r.turn_types is None or turn in r.turn_types)
                and (r.providers is None or provider in r.providers)
                and (r.models is None or model in r.models)
            ):
                return r
        pieces = self.pieces(ctx)
        return pieces[-1][1] if pieces else self.default

    def decide(self, ctx: RequestContext, adaptive: AdaptiveGamma) -> SpeculationPlan:
        r = self.match(ctx)
        f = r.fixed
        if f is not None:
            table = self.gamma_table(ctx, r, f.method, f.gamma, adaptive) if f.gamma > 0 else None
            reason = f.reason if ctx.batch_size is not None else f"batch size unknown; {f.reason}"
            return SpeculationPlan(
                f.method, f.gamma, f.rule, reason, f.policy_version, f.pool, dict(f.options), None, table
            )
        choice = adaptive.choose(ctx.turn_type, r.method, ctx.provider, r.gamma_lo, r.gamma_hi, r.prior_alpha)
        where = r.where if ctx.batch_size is not None else f"batch size unknown; {r.where}"
        if choice.gamma <= 0:
            return SpeculationPlan("off", 0, r.name, f"{where}; {choice.describe()}", self.version, r.pool, {},
                            (r.gamma_lo, r.gamma_hi))  # fmt: skip
        return SpeculationPlan(
            r.method, choice.gamma, r.name, f"{where}; {choice.describe()}", self.version, r.pool,
            dict(r.options), (r.gamma_lo, r.gamma_hi), self.gamma_table(ctx, r, r.method, choice.gamma, adaptive),
        )  # fmt: skip

    def pieces(self, ctx: RequestContext) -> list[tuple[int, CompiledRule]]:
        """The batch axis cut where the rules matching `ctx` (batch size aside) change, each
        piece with its first matching rule."""
        turns, providers, models = self._named
        t, p, m = ctx.turn_type, ctx.provider, ctx.model
        key = (t if t in turns else None, p if p in providers else None, m if m in models else None)
        found = self._pieces.get(key)
        if found is None:
            turn, provider, model = key
            entries = [
                (r.batch_lo, r.batch_hi, r)
                for r in (*self.rules, self.default)
                if (r.turn_types is None or turn in r.turn_types)
                and (r.providers is None or provider in r.providers)
                and (r.models is None or model in r.models)
            ]
            found = [(lo, rules[0]) for lo, rules in batch_segments(entries)]
            self._pieces.put(key, found)
        return found

    def gamma_table(
        self, ctx: RequestContext, decided: CompiledRule, method: SpecMethod, gamma: int, adaptive: AdaptiveGamma
    ) -> GammaTable | None:
        """γ of `method` at every batch size, given the decided rule gave `gamma`; None when it is
        `gamma` throughout.
        Pieces ruled by another method (or by `off`) draft nothing; an auto rule's γ is what the
        estimates say now (no probe); the decided piece keeps the plan's own γ."""
        model = ctx.model if ctx.model in self._named[2] else None  # pieces key it so too
        key = (ctx.turn_type, ctx.provider, model, decided.name, gamma)
        cached = self._tables.get(key)
        if cached is not None and cached[0] is adaptive and cached[1] == adaptive.version:
            return cached[2]
        version = adaptive.version  # read before the estimates: a racing observe only forces a rebuild
        rows: list[tuple[int, int]] = []
        for lo, r in self.pieces(ctx):
            if r is decided:
                g = gamma
            elif r.method != method:
                g = 0
            elif r.fixed is not None:
                g = r.fixed.gamma
            else:
                g = adaptive.peek(ctx.turn_type, r.method, ctx.provider, r.gamma_lo, r.gamma_hi, r.prior_alpha)
            if not rows or rows[-1][1] != g:
                rows.append((lo, g))
        table = None if len(rows) == 1 and rows[0][1] == gamma else GammaTable(tuple(rows))
        self._tables.put(key, (adaptive, version, table))
        return table
