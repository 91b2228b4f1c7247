"""One request's state across its decode: `Sequence`, made from what the caller asks
(`SequenceRequest`) and the target's side (`Target`); tokens accepted into it and the text and
result that come out of it. What one round plans and settles is a `Round` (round.py).

Cache invariant: the target's KV cache holds every token of `seq.tokens` except the last one
(`seq.tokens[-1]`, emitted but not yet fed).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from openalice_runner.engine import closing
from openalice_runner.engine.cost_model import PassCostModel
from openalice_runner.engine.drafters.base import Drafter
from openalice_runner.engine.errors import ContextLengthError, InvalidRequest
from openalice_runner.engine.grammar_constraint import GrammarConstraint
from openalice_runner.engine.kv_cache import KVCache
from openalice_runner.engine.round import Round
from openalice_runner.engine.sampling import TokenDraws
from openalice_runner.engine.stopping import TextStream
from openalice_runner.engine.types import (
    GenerationResult,
    GenerationStats,
    SamplingParams,
    SpecConfig,
    StreamEvent,
)


@dataclass
class Sequence:
    prompt: list[int]
    sampling: SamplingParams
    spec: SpecConfig
    drafter: Drafter | None
    cache: KVCache
    slot: int
    text: TextStream
    eos_ids: frozenset[int]
    context_length: int
    draws: TokenDraws | None = None  # None: greedy
    tokens: list[int] = field(default_factory=list)  # prompt + generated (EOS excluded)
    finish_reason: str | None = None
    stats: GenerationStats = field(default_factory=GenerationStats)
    accept_lengths: list[int] = field(default_factory=list)
    emitted_by_passes: int = 0  # tokens the decode passes produced, a stop token included
    started: float = 0.0
    costs: PassCostModel | None = None  # where target pass times are recorded
    constraint: GrammarConstraint | None = None  # the grammar the reply must follow (grammar.py)
    tenant: str | None = None  # whose request (SequenceRequest.tenant)
    budget: closing.Budget = field(default_factory=closing.Budget)  # closing within the budget (closing.py)

    @property
    def generated(self) -> int:
        return len(self.tokens) - len(self.prompt)

    @property
    def fixed_draft_length(self) -> bool:
        """A seeded sampled request whose drafter draws its drafts: γ every round (Drafter.samples)."""
        return (self.drafter is not None and self.drafter.samples and self.draws is not None
                and self.sampling.seed is not None)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class SequenceRequest:
    """What a caller asks of one sequence: its prompt, how to sample, how to speculate (and the
    drafter that does, if any) and the grammar the reply must follow."""

    prompt: list[int]
    sampling: SamplingParams
    spec: SpecConfig
    drafter: Drafter | None = None
    constraint: GrammarConstraint | None = None
    tenant: str | None = None  # whose request: prefix reuse stays within a tenant (batching.py)


@dataclass(frozen=True)
class Target:
    """The target model's side of a sequence: the cache its keys and values go to, the tokenizer
    its text comes from, the tokens that end it, its context and where pass times are recorded."""

    cache: KVCache
    tokenizer: Any
    eos_ids: frozenset[int]
    context_length: int
    costs: PassCostModel | None = None


def new_sequence(request: SequenceRequest, target: Target, slot: int = 0) -> Sequence:
    """A sequence ready to `begin`, in cache slot `slot` (a scheduler assigns it at admission)."""
    prompt, sampling, spec, context_length = request.prompt, request.sampling, request.spec, target.context_length
    if not prompt:
        raise InvalidRequest("prompt is empty", param="messages")
    if len(prompt) >= context_length:
        raise ContextLengthError(
            f"prompt has {len(prompt)} tokens; the model's context is {context_length} tokens "
            "and at least one must be left for the reply"
        )
    draws = None if sampling.greedy else TokenDraws(sampling.seed)
    return Sequence(
        prompt=list(prompt),
        sampling=sampling,
        spec=spec,
        drafter=request.drafter if spec.method != "off" else None,
        cache=target.cache,
        slot=slot,
        text=TextStream(target.tokenizer, sampling.stop),
        eos_ids=target.eos_ids,
        context_length=context_length,
        draws=draws,
        costs=target.costs,
        constraint=request.constraint,
        tenant=request.tenant,
        budget=closing.Budget(request.constraint, target.eos_ids),
    )


def tokens_left(seq: Sequence) -> int:
    """Tokens the reply may still emit: its budget and the context's end."""
    return min(seq.sampling.max_tokens - seq.generated, seq.context_length - len(seq.tokens))


def begin(seq: Sequence) -> None:
    seq.started = time.perf_counter()
    if seq.drafter is not None:
        seq.drafter.start(seq.prompt)
    seq.tokens = list(seq.prompt)


def accept_tokens(seq: Sequence, tokens: list[int], from_pass: bool = False) -> list[int]:
    """Append emitted tokens, applying EOS, the token budget and the context limit."""
    kept: list[int] = []
    produced = 0  # tokens of this pass up to where the sequence ends, its stop token included
    for token in tokens:
        produced += 1
        if token in seq.eos_ids:
            seq.finish_reason = "stop"
            break
        kept.append(token)
        if seq.generated + len(kept) >= seq.sampling.max_tokens:
            seq.finish_reason = "length"
            break
        if len(seq.tokens) + len(kept) >= seq.context_length:
            seq.finish_reason = "length"
            break
    seq.tokens.extend(kept)
    if seq.constraint is not None and not seq.finished:
        seq.constraint.advance(kept)
    if from_pass:
        # A pass that ends the reply on its stop token still produced a token: counting only the kept
        # ones put a plain reply that stops below one token per pass.
        seq.emitted_by_passes += produced
    return kept


def preview_forced(seq: Sequence, planned: Round) -> StreamEvent | None:
    """The text of this round's forced tokens, sent before the pass that verifies them: the
    grammar allows nothing else there, so the pass accepts them whatever the model says (the
    masked target puts all its mass on each). A tool call's name and opening, JSON keys and
    punctuation thus stream a pass earlier. Stop strings change nothing: one the forced text
    completes ends the reply there whatever the pass says, and the text stream holds back a
    possible beginning of one as always. `emit` leaves the previewed tokens out afterwards."""
    if not planned.forced or seq.text.stopped:
        return None
    forced = planned.draft[: planned.forced]
    planned.previewed = len(forced)
    delta = seq.text.add(forced)
    return StreamEvent(delta, forced)


def emit(seq: Sequence, tokens: list[int], planned: Round | None = None) -> StreamEvent | None:
    """The stream event for tokens just accepted (None when there is nothing to say), less the
    ones `planned`, the round they came from, previewed before its pass; a stop string found in
    the text ends the sequence."""
    previewed = 0 if planned is None else planned.previewed
    if previewed:
        if len(tokens) < previewed:  # pragma: no cover - forced tokens are always accepted
            raise RuntimeError(f"{previewed} previewed forced tokens, but the pass accepted {len(tokens)}")
        tokens = tokens[previewed:]
    delta = seq.text.add(tokens)
    if seq.text.stopped:
        seq.finish_reason = "stop"
    return StreamEvent(delta, tokens) if delta or tokens else None


def final_event(seq: Sequence) -> StreamEvent:
    rest = seq.text.finish()
    return StreamEvent(rest, [], result=finish(seq))


def finish(seq: Sequence) -> GenerationResult:
    stats = seq.stats
    stats.method = seq.spec.method
    stats.gamma = seq.spec.gamma if seq.spec.method != "off" else 0
    stats.prompt_tokens = len(seq.prompt)
    stats.completion_tokens = len(seq.text.token_ids)
    stats.total_s = time.perf_counter() - seq.started
    stats.finish_reason = seq.finish_reason or "length"
    if seq.constraint is not None:
        stats.mask_s = seq.constraint.mask_s
        stats.closing = seq.budget.closing
    if stats.proposed:
        stats.acceptance_rate = stats.accepted / stats.proposed
    if stats.target_passes:
        stats.tokens_per_pass = seq.emitted_by_passes / stats.target_passes
    if seq.accept_lengths:
        histogram = [0] * (max(seq.accept_lengths) + 1)
        for n in seq.accept_lengths:
            histogram[n] += 1
        stats.accept_length_histogram = histogram
    if stats.total_s > 0:
        stats.tokens_per_second = stats.completion_tokens / stats.total_s
    return GenerationResult(
        text=seq.text.text, token_ids=list(seq.text.token_ids), stats=stats, stop=seq.text.matched
    )
