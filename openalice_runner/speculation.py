"""The speculation vocabulary every layer shares: what a policy asks for, what a provider reports.

Torch-free and provider-neutral. A policy hands a provider a `SpeculationPlan` (method, γ, a γ
by batch size table, drafter options); the provider realises it however it can (the embedded
engine drafts, an SGLang pool was launched for it) and reports a `SpeculationOutcome` (proposed,
accepted, target passes, accepted-length histogram, timings). The policy learns from outcomes,
tracing records them, the HTTP API shows them (`types.SpeculationInfo`). As vLLM keeps its
spec-decode metadata and metrics apart from proposers and sampler.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, get_args

if TYPE_CHECKING:
    from openalice_runner.policies import RequestContext

from openalice_runner.first_token import FirstTokenBreakdown

SpecMethod = Literal["off", "ngram", "draft", "eagle", "suffix"]  # suffix: prompt lookup + recent responses (engine)
SPEC_METHODS: tuple[str, ...] = get_args(SpecMethod)
MAX_GAMMA = 64  # the most draft tokens one round may propose


@dataclass(frozen=True, slots=True)
class GammaTable:
    """γ by live batch size, as rows of (first batch size, γ): a row holds from its batch size up
    to the next row's. γ 0 drafts nothing at that size. The same shape as SGLang's
    `--speculative-adaptive-config` (integer keys, the largest key <= the batch size wins)."""

    rows: tuple[tuple[int, int], ...]

    def __post_init__(self) -> None:
        starts = [lo for lo, _ in self.rows]
        if not starts or starts[0] != 1 or any(a >= b for a, b in zip(starts, starts[1:], strict=False)):
            raise ValueError(f"GammaTable rows must start at batch size 1 and increase, got {self.rows!r}")
        if any(not (0 <= g <= MAX_GAMMA) for _, g in self.rows):
            raise ValueError(f"GammaTable γ must be in [0, {MAX_GAMMA}], got {self.rows!r}")

    @classmethod
    def constant(cls, gamma: int) -> GammaTable:
        return cls(((1, gamma),))

    def at(self, batch_size: int) -> int:
        i = bisect_right(self.rows, (max(1, batch_size), MAX_GAMMA + 1)) - 1
        return self.rows[i][1]

    def to_dict(self) -> dict[str, int]:
        return {str(lo): g for lo, g in self.rows}


@dataclass(frozen=True, slots=True)
class SpeculationPlan:
    """What a policy decided for one call. `gamma` is γ at the batch size decided for (0: off);
    `per_batch` is γ as the live batch grows and shrinks (None: `gamma` throughout); `options`
    are the drafter's settings (n-gram sizes, EAGLE head, tree size), passed through as data."""

    method: SpecMethod = "off"
    gamma: int = 0
    rule: str = "default"
    reason: str = ""
    policy_version: str = ""
    pool: str | None = None
    options: Mapping[str, Any] = field(default_factory=dict)
    gamma_range: tuple[int, int] | None = None  # the rule's [min_gamma, max_gamma] when γ is auto
    per_batch: GammaTable | None = None

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ValueError(f"method must be one of {SPEC_METHODS}, got {self.method!r}")

    @property
    def speculates(self) -> bool:
        return self.method != "off" and self.gamma > 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "gamma": self.gamma,
            "rule": self.rule,
            "reason": self.reason,
            "policy_version": self.policy_version,
            "pool": self.pool,
            "options": dict(self.options),
            "gamma_range": list(self.gamma_range) if self.gamma_range else None,
            "per_batch": self.per_batch.to_dict() if self.per_batch else None,
        }


@dataclass(frozen=True, slots=True)
class SpeculationOutcome:
    """What speculation did for one finished call, as the provider measured or was told.

    `accept_length_histogram[k]` counts verify rounds that accepted k drafts. `probe_*` are
    exploratory drafts (the drafter expected them to lose; counted in `proposed`/`accepted`)
    that the policy leaves out of α. Times are seconds; None where the provider cannot know."""

    method: str = "off"
    gamma: int = 0
    completion_tokens: int = 0
    target_passes: int = 0  # target forward passes after prefill (decode or verify)
    proposed: int = 0
    accepted: int = 0
    probe_proposed: int = 0
    probe_accepted: int = 0
    # tokens a grammar forced and the round drafted for free (always accepted; not in `proposed`)
    forced: int = 0
    accept_length_histogram: tuple[int, ...] = ()
    # tokens the target's passes emitted per pass (>= 1; 1 for plain decoding); None: unknown
    tokens_per_pass: float | None = None
    # the number of draft tokens one round could propose when that differs per round (SGLang's
    # adaptive pools): α then comes from the histogram, never from a rate against `gamma`
    gamma_varies: bool = False
    ttft_s: float | None = None
    queue_s: float | None = None
    prefill_s: float | None = None
    draft_s: float | None = None
    verify_s: float | None = None
    total_s: float | None = None
    rule: str | None = None
    policy_version: str | None = None
    pool: str | None = None
    first_token: FirstTokenBreakdown | None = None  # where the time before the first token went

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def tokens_per_second(self) -> float | None:
        if not self.total_s or self.total_s <= 0:
            return None
        return self.completion_tokens / self.total_s

    @property
    def decode_s(self) -> float | None:
        if self.ttft_s is None or self.total_s is None:
            return None
        return max(0.0, self.total_s - self.ttft_s)


class SpeculationPolicy(Protocol):
    """What the Runner asks before each call and tells after it: a PolicyStore, or anything with these
    two methods (`watch_policy` also needs PolicyStore's start_watching / stop_watching)."""

    def decide(self, ctx: RequestContext) -> SpeculationPlan: ...

    # PolicyStore also takes `tenant=` (adaptive γ per tenant); it is passed only for requests that have one
    def observe(self, turn_type: str, method: str, provider: str | None, outcome: SpeculationOutcome) -> None: ...


# Keys the JSON contracts used to carry, kept one release beside the names above (docs/vocabulary.md):
# per contract, (old key, key now). The one place the old names live; nothing reads them.
OLD_KEYS: Mapping[str, tuple[tuple[str, str], ...]] = {
    "stats": (  # the CLI's `generate --json` stats (engine GenerationStats.to_dict)
        ("mean_tokens_per_pass", "tokens_per_pass"),
        ("draft_proposed", "proposed"),
        ("draft_accepted", "accepted"),
        ("forced_tokens", "forced"),
        ("closing_tokens", "closing"),
    ),
    "speculation": (("accept_length", "tokens_per_pass"),),  # the HTTP API's `speculation` block
    "bench": (("mean_accept_length", "tokens_per_pass"),),  # `bench` JSON rows
    "bench_concurrency": (("mean_tokens_per_pass", "tokens_per_pass"),),  # `bench-concurrency` JSON runs
    "span": (("openalice.speculation.mean_tokens_per_pass", "openalice.speculation.tokens_per_pass"),),
}


def with_old_keys(contract: str, data: dict[str, Any]) -> dict[str, Any]:
    """`data` with each renamed key of `contract` also under its old name (same value), in place."""
    for old, now in OLD_KEYS[contract]:
        if now in data:
            data[old] = data[now]
    return data
