"""Deciding: a request's context -> method and γ, by the first matching rule of a compiled policy.

Compilation turns each rule into plain sets and ints once, at load time, so a decision is a short
loop of set lookups and comparisons (a few µs); rules with a fixed γ have their reason text prebuilt.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from openalice_runner.policies.adaptive import AdaptiveGamma
from openalice_runner.policies.schema import DecisionSpec, Policy

_INF = float("inf")


@dataclass(frozen=True, slots=True)
class RequestContext:
    turn_type: str = "chat"
    batch_size: int = 1
    provider: str | None = None  # provider or SGLang pool name the request will go to
    model: str | None = None


@dataclass(frozen=True, slots=True)
class Decision:
    method: str  # off | ngram | draft | eagle
    gamma: int  # 0 when off
    rule: str  # name of the rule that matched, or "default"
    reason: str
    policy_version: str
    pool: str | None = None
    options: dict[str, Any] = field(default_factory=dict)

    def to_spec_config(self):  # -> openalice_runner.engine.types.SpecConfig
        from openalice_runner.engine.types import SpecConfig

        if self.method == "off" or self.gamma <= 0:
            return SpecConfig(method="off", gamma=0)
        return SpecConfig(method=self.method, gamma=self.gamma, **self.options)  # type: ignore[arg-type]

    def to_dict(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "gamma": self.gamma,
            "rule": self.rule,
            "reason": self.reason,
            "policy_version": self.policy_version,
            "pool": self.pool,
            "options": dict(self.options),
        }


@dataclass(frozen=True, slots=True)
class CompiledRule:
    name: str
    turn_types: frozenset[str] | None
    providers: frozenset[str] | None
    models: frozenset[str] | None
    batch_lo: int
    batch_hi: float
    method: str
    auto: bool
    gamma_lo: int
    gamma_hi: int
    pool: str | None
    options: dict[str, Any]
    prior_alpha: float | None
    fixed: Decision | None  # prebuilt when γ is fixed (or off)
    where: str  # e.g. "rule 'copy' (#1)", for reasons


def _names(v: str | list[str] | None) -> frozenset[str] | None:
    return None if v is None else frozenset([v] if isinstance(v, str) else v)


def _compile_one(spec: DecisionSpec, name: str, where: str, version: str, match: Any | None) -> CompiledRule:
    lo, hi = spec.gamma_bounds
    options = {k: v for k, v in spec.options.model_dump().items() if v is not None}
    auto = spec.auto and spec.method != "off"
    fixed = None
    if not auto:
        text = f"{where}: {spec.method}" + (f" gamma {lo}" if spec.method != "off" else "")
        fixed = Decision(spec.method, lo, name, text, version, spec.pool, options)
    b = match.batch_size if match is not None else None
    return CompiledRule(
        name=name,
        turn_types=_names(match.turn_type) if match is not None else None,
        providers=_names(match.provider) if match is not None else None,
        models=_names(match.model) if match is not None else None,
        batch_lo=b.min if b else 1,
        batch_hi=(b.max if b and b.max is not None else _INF),
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
    """A validated policy in decision-ready form. Immutable; swapped whole on reload."""

    __slots__ = ("policy", "version", "rules", "default")

    def __init__(self, policy: Policy, version: str):
        self.policy = policy
        self.version = version
        self.rules: tuple[CompiledRule, ...] = tuple(
            _compile_one(r, r.name, f"rule {r.name!r} (#{i})", version, r.match)
            for i, r in enumerate(policy.rules)
        )
        self.default = _compile_one(policy.default, "default", "no rule matched, default", version, None)

    def match(self, ctx: RequestContext) -> CompiledRule:
        turn, batch, provider, model = ctx.turn_type, ctx.batch_size, ctx.provider, ctx.model
        for r in self.rules:
            if (
                (r.turn_types is None or turn in r.turn_types)
                and r.batch_lo <= batch <= r.batch_hi
                and (r.providers is None or provider in r.providers)
                and (r.models is None or model in r.models)
            ):
                return r
        return self.default

    def decide(self, ctx: RequestContext, adaptive: AdaptiveGamma) -> Decision:
        r = self.match(ctx)
        if r.fixed is not None:
            f = r.fixed  # fresh object each time: callers may mutate `options`
            return Decision(f.method, f.gamma, f.rule, f.reason, f.policy_version, f.pool, dict(f.options))
        choice = adaptive.choose(ctx.turn_type, r.method, ctx.provider, r.gamma_lo, r.gamma_hi, r.prior_alpha)
        method = r.method if choice.gamma > 0 else "off"
        options = dict(r.options) if choice.gamma > 0 else {}
        return Decision(
            method, choice.gamma, r.name, f"{r.where}; {choice.describe()}", self.version, r.pool, options
        )
