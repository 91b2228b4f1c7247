"""Plain data types of the embedded engine: what a request asks for and what it reports.

These are dataclasses, not pydantic models: the engine is internal and hot; validation of
user input happens at the edges (CLI, Runner types, HTTP server) before it gets here, and what
still arrives out of range is refused here as `InvalidRequest` (errors.py), naming the field.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Literal

from openalice_runner.drafter_options import DRAFTER_OPTIONS, OPTION, ngram_problem
from openalice_runner.engine.errors import InvalidRequest
from openalice_runner.speculation import (
    MAX_GAMMA,
    SPEC_METHODS,
    GammaTable,
    SpecMethod,
    SpeculationOutcome,
    SpeculationPlan,
    with_old_keys,
)

FinishReason = Literal["stop", "length", "context_length", "cancelled"]


class EngineOverloaded(RuntimeError):
    """The batching scheduler's waiting line is full: refused at once, not queued without bound."""


class SchedulerStopped(RuntimeError):
    """The scheduler thread that owed a request its answer is gone (a fault of ours, never the client's)."""


# A temperature this small is the argmax up to fp32 precision, and dividing logits by one far smaller
# overflows to inf and a NaN distribution (5e-324 from a fuzzer did): it decodes greedily, as vLLM's 1e-5.
GREEDY_BELOW = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """Decoding settings, applied identically to target and draft distributions."""

    temperature: float = 0.0  # below GREEDY_BELOW (0 included) means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means no top-k cut
    seed: int | None = None
    max_tokens: int = 256
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not (self.temperature >= 0.0):
            raise InvalidRequest(f"temperature must be >= 0, got {self.temperature!r}", param="temperature")
        if not (0.0 < self.top_p <= 1.0):
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p!r}", param="top_p")
        if self.top_k < 0:
            raise InvalidRequest(f"top_k must be >= 0, got {self.top_k!r}", param="top_k")
        if self.max_tokens < 1:
            raise InvalidRequest(f"max_tokens must be >= 1, got {self.max_tokens!r}", param="max_tokens")
        if any(not s for s in self.stop):
            raise InvalidRequest("stop strings must be non-empty", param="stop")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


@dataclass(frozen=True)
class SpecConfig:
    """How one request speculates. `gamma` is the number of draft tokens per round."""

    method: SpecMethod = "off"
    gamma: int = 5
    # the drafter options: defaults and limits in drafter_options.py
    ngram_min: int = OPTION["ngram_min"].default
    ngram_max: int = OPTION["ngram_max"].default
    draft_model: str | None = None  # path of a separate draft LM sharing the vocabulary
    draft_layers: int | None = None  # self-draft from the target's first N layers
    eagle_head: str | None = None  # path of a trained EAGLE-style head
    # eagle: draft by prompt lookup (ngram_min..ngram_max) where the context has a match worth
    # drafting, by the head elsewhere (`drafters/lookup_first.py`)
    eagle_lookup: bool = OPTION["eagle_lookup"].default
    # eagle: draft a tree of up to this many tokens (top-k candidates at each depth, verified in
    # one pass, `engine/tree.py`) instead of a chain; 0 drafts a chain
    eagle_tree: int = OPTION["eagle_tree"].default
    # n-gram and eagle drafters cut a draft below γ where the engine's measured pass costs say
    # the longer one will not pay; False: every draft is γ long (fixed-γ experiments, tests)
    adaptive_length: bool = True
    # γ by live batch size (running + waiting), looked up at every step of the batching engine;
    # None: `gamma` throughout. A row's γ is capped by nothing here: the policy compiled it.
    per_batch: GammaTable | None = None
    # under a grammar, draft the tokens it forces (free: always accepted) before the drafter's;
    # applies with method "off" too. False: forced tokens are decoded one pass each (benchmarks)
    forced_drafts: bool = True

    @classmethod
    def from_plan(cls, plan: SpeculationPlan) -> SpecConfig:
        """The engine's settings for a policy's plan (`options` are this engine's drafter knobs)."""
        if not plan.speculates:
            return cls(method="off", gamma=0)
        return cls(method=plan.method, gamma=plan.gamma, per_batch=plan.per_batch, **plan.options)

    @property
    def draft_rows(self) -> int:
        """The most draft tokens one round feeds (a tree may hold more tokens than γ, its depth)."""
        table = max((g for _, g in self.per_batch.rows), default=0) if self.per_batch else 0
        return max(self.gamma, self.eagle_tree, table)

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise InvalidRequest(f"method must be one of {SPEC_METHODS}, got {self.method!r}", param="method")
        if self.method != "off" and not (1 <= self.gamma <= MAX_GAMMA):
            raise InvalidRequest(f"gamma must be in [1, {MAX_GAMMA}], got {self.gamma!r}", param="gamma")
        self._check_options()

    def _check_options(self) -> None:
        """The drafter options' limits and methods, as drafter_options.py defines them."""
        if wrong := ngram_problem(self.ngram_min, self.ngram_max):
            raise InvalidRequest(wrong, param="ngram_min")
        for option in DRAFTER_OPTIONS:
            value = getattr(self, option.name)
            if option.switch and value and self.method not in option.methods:
                methods = " or ".join(sorted(option.methods))
                raise InvalidRequest(f"{option.name} applies to method {methods} only, got method {self.method!r}",
                                     param=option.name)
            if (wrong := option.problem(value)) is not None:
                raise InvalidRequest(wrong, param=option.name)


@dataclass
class FirstTokenTimes:
    """The engine's share of the time before a request's first token, in seconds (issue 49).

    `queue_s`: submitted until admitted to a cache slot; `prefix_match_s`: finding the slot that holds
    the longest cached prefix; `chunks`: each prefill pass as [prompt tokens, seconds] (a pass shared
    with other sequences' rows counts whole); `first_token_s`: choosing the first token from the last
    chunk's logits (grammar mask, sampling); `first_decode_s`: from that choice until the first decode
    round had settled (the wait for the scheduler's next step and the pass), kept only where the first
    token's text was empty, so that the caller's first text came after that round (None otherwise)."""

    queue_s: float = 0.0
    prefix_match_s: float = 0.0
    chunks: list[list[float]] = field(default_factory=list)
    first_token_s: float = 0.0
    first_decode_s: float | None = None

    @property
    def prefill_s(self) -> float:
        return sum(seconds for _, seconds in self.chunks)


@dataclass
class GenerationStats:
    """Figures every finished request reports (the CLI's JSON `stats`, snake_case, is a contract).

    The shared fields carry `SpeculationOutcome`'s names (speculation.py); the engine's extras, which
    the outcome has no field for, follow them under "engine extras"."""

    method: str = "off"
    gamma: int = 0
    completion_tokens: int = 0
    target_passes: int = 0  # target forward passes after prefill (decode or verify)
    proposed: int = 0  # draft tokens proposed
    accepted: int = 0  # of those, accepted
    # of those, exploratory drafts (see Proposal.probe): counted above, left out of the policy's α
    probe_proposed: int = 0
    probe_accepted: int = 0
    forced: int = 0  # tokens a grammar forced, drafted for free (not in proposed)
    acceptance_rate: float = 0.0  # accepted / proposed (0 when nothing was proposed)
    # tokens the target passes produced / target passes: >= 1, exactly 1 for plain decoding (a stop token
    # a pass produced counts; the first token, from the prefill, does not)
    tokens_per_pass: float = 0.0
    accept_length_histogram: list[int] = field(default_factory=list)  # [n rounds that accepted k drafts]
    ttft_s: float = 0.0
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    total_s: float = 0.0
    tokens_per_second: float = 0.0  # completion tokens / total time, prefill included
    rule: str | None = None  # policy rule that decided method and gamma, when a policy did
    policy_version: str | None = None
    # engine extras
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0  # of those, found in the cache (prefix reuse) and not prefilled
    closing: int = 0  # tokens forced to close the grammar's structure within the budget (closing.py)
    mask_s: float = 0.0  # time spent computing grammar masks
    # [d][a]: rounds whose drafter's tokens reached depth d (a chain's length, a tree's deepest node)
    # and accepted a of them: what the exactness tests read to show drafts of every length ran
    draft_depth_histogram: list[list[int]] = field(default_factory=list)
    finish_reason: str = "length"
    first_token: FirstTokenTimes = field(default_factory=FirstTokenTimes)  # where the time to it went

    def count_round(self, proposed: int, accepted: int, parents: list[int] | None = None) -> None:
        """One round of the drafter's: `proposed` tokens (a tree's nodes where `parents`), `accepted` of them."""
        depth = proposed
        if parents is not None:
            depths: list[int] = []
            for parent in parents:
                depths.append(1 if parent < 0 else depths[parent] + 1)
            depth = max(depths, default=0)
        while len(self.draft_depth_histogram) <= depth:
            self.draft_depth_histogram.append([0] * (len(self.draft_depth_histogram) + 1))
        self.draft_depth_histogram[depth][accepted] += 1

    def to_dict(self) -> dict:
        """The CLI's JSON `stats`, the renamed keys also under their old names for one release."""
        return with_old_keys("stats", asdict(self))

    def outcome(self, pool: str | None = None) -> SpeculationOutcome:
        """The provider-neutral figures of this request (what the policy, tracing and API read)."""
        return SpeculationOutcome(
            method=self.method,
            gamma=self.gamma,
            completion_tokens=self.completion_tokens,
            target_passes=self.target_passes,
            proposed=self.proposed,
            accepted=self.accepted,
            probe_proposed=self.probe_proposed,
            probe_accepted=self.probe_accepted,
            forced=self.forced,
            accept_length_histogram=tuple(self.accept_length_histogram),
            tokens_per_pass=self.tokens_per_pass or None,
            ttft_s=self.ttft_s,
            prefill_s=self.prefill_s,
            draft_s=self.draft_s,
            verify_s=self.verify_s,
            total_s=self.total_s,
            rule=self.rule,
            policy_version=self.policy_version,
            pool=pool,
        )


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    stats: GenerationStats
    stop: str | None = None  # the stop string that ended the text (Anthropic's stop_sequence)

    @property
    def finish_reason(self) -> str:
        return self.stats.finish_reason


@dataclass
class StreamEvent:
    """One piece of a token stream: text accepted in one round (possibly several tokens).

    The last event of a stream has `result` set and an empty or final `text`.
    """

    text: str
    token_ids: list[int]
    result: GenerationResult | None = None
