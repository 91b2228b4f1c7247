"""The decode loop: prefill, then rounds of (propose, verify in one target pass, roll back).

Plain decoding is the same round with nothing proposed, so one code path serves every method.
The state of one request lives in `Sequence`; `prefill` and `decode_round` are small
functions over it, so a scheduler can interleave many sequences (continuous batching).

Cache invariant: the target's KV cache holds every token of `seq.tokens` except the last one
(`seq.tokens[-1]`, emitted but not yet fed). A round feeds that token plus k drafts, and rolls
the cache back to the accepted prefix by moving the slot's length pointer.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from openalice_runner.engine import closing
from openalice_runner.engine.cost_model import PassCostModel
from openalice_runner.engine.cpu_kernels import cpu_kernels
from openalice_runner.engine.drafters.base import Drafter, Proposal, observed_rows, taps_for
from openalice_runner.engine.errors import ContextLengthError, InvalidRequest
from openalice_runner.engine.grammar import GrammarConstraint, masked_logits, masked_probs
from openalice_runner.engine.llama import KVCache, LlamaModel
from openalice_runner.engine.rejection import Verdict, verify_greedy, verify_sampled
from openalice_runner.engine.sampling import TokenDraws, processed_probs, sample, stream
from openalice_runner.engine.stopping import TextStream
from openalice_runner.engine.tree import (
    TreeMask,
    TreeVerdict,
    tree_rows,
    verify_tree_greedy,
    verify_tree_sampled,
)
from openalice_runner.engine.types import (
    GenerationResult,
    GenerationStats,
    SamplingParams,
    SpecConfig,
    StreamEvent,
)

PREFILL_CHUNK = 512  # tokens per prefill pass: bounds the attention-score memory
MAX_FORCED = 16  # grammar-forced tokens drafted in one round (they ride the pass for free)


@dataclass
class Round:
    """One decode round as planned (`plan_round`) and settled (`settle_round`); k: the draft's
    length, V: the vocabulary. What lives across rounds stays on `Sequence`."""

    proposal: Proposal  # the drafter's, as drafted: tokens (k,), q (k, V) or None, parents (k,) for a tree
    draft: list[int]  # (k,) fed after the last token: forced, the drafter's, forced after (a tree's nodes in order)
    start: int  # the cache position where the last token is fed; the draft follows from start + 1
    masks: torch.Tensor | None = None  # (k+1, V) bool: the grammar's allowed tokens at each row (None: no grammar)
    forced: int = 0  # the draft's first tokens, forced by the grammar (always accepted once reached)
    forced_after: int = 0  # its last tokens, forced after the drafter's (constrained_round)
    left: int = 0  # a window round (closing.py): the tokens left, each kept only where the closing fits after
    closing: int = 0  # a closing round: the tokens it forces to close (the draft and the bonus row)
    previewed: int = 0  # forced tokens whose text went out before the pass (preview_forced)

    def tree_mask(self) -> TreeMask | None:
        """The pass's mask over the round's rows (None for a chain)."""
        if self.proposal.parents is None:
            return None
        return TreeMask.from_rows(tree_rows(self.start, self.proposal.parents))


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


def tokens_left(seq: Sequence) -> int:
    """Tokens the reply may still emit: its budget and the context's end."""
    return min(seq.sampling.max_tokens - seq.generated, seq.context_length - len(seq.tokens))


def choose_token(logits: torch.Tensor, seq: Sequence) -> int:
    allowed = None if seq.constraint is None else seq.constraint.allowed()
    if allowed is not None:
        left = tokens_left(seq)
        state, path, _ = closing.mode(seq.budget, seq.tokens, left, 0)
        if state == closing.CLOSING:
            seq.budget.closing += 1
            return path[0]
        if state == closing.WINDOWED:
            return budget_choice(logits, seq, allowed, left, path, len(seq.tokens))
    if seq.sampling.greedy:
        return greedy_choices(logits.unsqueeze(0), None if allowed is None else allowed.unsqueeze(0))[0]
    if allowed is not None:
        logits = masked_logits(logits, allowed)
    # the token lands at position len(seq.tokens): it draws from that position's stream
    return sample(processed_probs(logits, seq.sampling), stream(seq.draws, len(seq.tokens), TokenDraws.TARGET))


def prefill(model: LlamaModel, seq: Sequence, reused: int = 0) -> list[int]:
    """Feed the prompt in chunks and pick the first token from its last position. `reused`: the
    cache already holds the first `reused` prompt tokens' keys and values (prefix reuse; at most
    all but the last prompt token, whose logits start the reply)."""
    start = time.perf_counter()
    seq.cache.lengths[seq.slot] = reused
    seq.stats.cached_prompt_tokens = reused
    hidden = None
    wants_hidden = seq.drafter is not None and seq.drafter.wants_hidden
    taps = taps_for([seq.drafter])
    for i in range(reused, len(seq.prompt), PREFILL_CHUNK):
        chunk = torch.tensor([seq.prompt[i : i + PREFILL_CHUNK]])
        hidden, tapped = _forward(model, chunk, seq, taps, prompt=True)
        if wants_hidden:
            seq.drafter.observe(observed_rows(seq.drafter, hidden[0], tapped, taps))
    first = choose_token(model.logits(hidden[0, -1]), seq)
    seq.stats.prefill_s = time.perf_counter() - start
    # The invariant holds again: `first` is the emitted but not yet fed last token.
    return accept_tokens(seq, [first])


def round_rows(spec: SpecConfig, constrained: bool) -> int:
    """The most tokens one round drafts after the last one: the drafter's rows, and under a grammar
    the forced tokens before them (with speculation off too). Caches are sized for this."""
    return spec.draft_rows + (MAX_FORCED if constrained and spec.forced_drafts else 0)


def plan_round(seq: Sequence, gamma: int) -> Round:
    """This round: the drafter's proposal (possibly empty), cut to what the budget and the context
    leave room for, and the draft tokens to feed after the last token (a tree's nodes in order).

    Under a grammar the draft starts with the tokens the grammar forces (when `spec.forced_drafts`;
    no drafter work, always accepted), the drafter continues from there, and the draft ends at
    the first token the grammar forbids; the masks along it are kept for verification. A draft the
    grammar allows to its end carries on through the tokens the grammar forces after it."""
    start = seq.cache.lengths[seq.slot]  # where the last token is fed (the cache invariant)
    window = 0
    room_context = seq.context_length - len(seq.tokens)  # cache after the pass holds len + k
    room_budget = seq.sampling.max_tokens - seq.generated
    if seq.constraint is not None:  # near the budget's end, the reply closes within it (closing.py)
        left = min(room_budget, room_context)
        state, path, room = closing.mode(seq.budget, seq.tokens, left, round_rows(seq.spec, True) + gamma)
        if state == closing.CLOSING:
            return closing_round(seq, path, left, start)
        if state == closing.WINDOWED:  # drafted as ever; the verdict keeps only tokens the closing fits after
            window = left
        room_budget = min(room_budget, room)  # a free round ends at the window's edge
    forced: list[int] = []
    if seq.constraint is not None and seq.spec.forced_drafts:
        forced = seq.constraint.forced(min(MAX_FORCED, room_budget - 1, room_context))
    max_draft = min(gamma, room_budget - 1 - len(forced), room_context - len(forced))
    proposal = Proposal([])
    # a drafter reading hidden states has none for forced tokens not yet fed: forced only then
    drafting = seq.drafter is not None and max_draft > 0 and not (forced and seq.drafter.wants_hidden)
    if drafting:
        t0 = time.perf_counter()
        generator = None if seq.draws is None else seq.draws.stream(len(seq.tokens), TokenDraws.DRAFT)
        proposal = seq.drafter.propose(seq.tokens + forced, max_draft, seq.sampling, generator)
        seq.stats.draft_s += time.perf_counter() - t0
        # a tree may hold more tokens than γ: they must fit the context and the cache
        room_cache = seq.cache.max_len - len(seq.tokens) - len(forced)
        proposal = proposal.cut(max_draft, min(room_context - len(forced), room_cache))
    if seq.constraint is None:
        return Round(proposal, proposal.tokens, start)
    room_after = 0  # forced tokens after the draft: within round_rows and the room left
    if proposal.tokens and seq.spec.forced_drafts:
        drafted = len(forced) + len(proposal.tokens)
        room_after = min(MAX_FORCED - len(forced), room_budget - 1 - drafted, room_context - drafted,
                         seq.cache.max_len - len(seq.tokens) - drafted)
    return constrained_round(seq, forced, proposal, Round(proposal, [], start, left=window), room_after)


def closing_round(seq: Sequence, path: list[int], left: int, start: int) -> Round:
    """A round that forces the closing path: its tokens drafted for free (they are the only
    ones the budget-masked target allows) and the pass's bonus row on the path too. Without
    `spec.forced_drafts` nothing is drafted: the pass's one row takes the path's next token."""
    most = MAX_FORCED if seq.spec.forced_drafts else 0
    k = min(most, left - 1, len(path) - 1, seq.cache.max_len - len(seq.tokens))
    masks = closing.onehot_rows(path[: k + 1], seq.constraint.vocab_size)
    return Round(Proposal(path[:k]), path[:k], start, masks, forced=k, closing=k + 1)


def budget_choice(logits: torch.Tensor, seq: Sequence, allowed: torch.Tensor, left: int, path: list[int] | None,
                  position: int, use: int = TokenDraws.TARGET) -> int:
    """A window position's token (closing.windowed_choice): the target's greedy choice or draw among
    the grammar's tokens after which the closing still fits; `position`: where it lands, `use`: the
    draws' stream (a redraw after the round's own draw takes a stream of its own)."""
    if seq.sampling.greedy:
        pick = lambda mask: greedy_choices(logits.unsqueeze(0), mask.unsqueeze(0))[0]  # noqa: E731
        return closing.windowed_choice(seq.budget, position, allowed, left, path, pick, lambda mask, _: pick(mask))
    probs = processed_probs(masked_logits(logits, allowed), seq.sampling)
    generator = stream(seq.draws, position, use)

    def draw(mask: torch.Tensor, _=None) -> int | None:
        kept = torch.zeros_like(probs)
        kept[: mask.shape[-1]] = probs[: mask.shape[-1]] * mask.to(probs.dtype)
        total = float(kept.sum())
        return None if total <= 0 else sample(kept / total, generator)

    return closing.windowed_choice(seq.budget, position, allowed, left, path, draw, draw)


def constrained_round(seq: Sequence, forced: list[int], proposal: Proposal, planned: Round,
                      room_after: int = 0) -> Round:
    """`planned` with its draft: forced tokens, then the drafter's chain (a tree's first branch),
    cut where the grammar forbids a token, and the masks and forced counts along it.

    Where the grammar allows the whole chain and then forces tokens (a tool call's opening after
    its tag, a key after a value), up to `room_after` of them follow the chain: certain once the
    chain is accepted, so the pass that verifies a draft reaching a forced span takes the span
    too, instead of leaving it to the next pass."""
    if proposal.parents is not None:
        proposal = first_branch(proposal)
    tokens = forced + proposal.tokens
    n, planned.masks, after = seq.constraint.walk_on(tokens, room_after)
    planned.forced = min(len(forced), n)
    planned.forced_after = len(after)
    tokens += after
    q = proposal.q
    if q is not None:
        q = torch.cat([_onehot(forced, q), q[: len(proposal.tokens)], _onehot(after, q)])[:n]
    planned.proposal, planned.draft = Proposal(tokens[:n], q, proposal.probe), tokens[:n]
    return planned


def _onehot(tokens: list[int], like: torch.Tensor) -> torch.Tensor:
    """Draft distributions of forced tokens: all mass on each (rows shaped like `like`'s)."""
    out = torch.zeros(len(tokens), like.shape[-1], dtype=like.dtype)
    out[torch.arange(len(tokens)), torch.tensor(tokens, dtype=torch.long)] = 1.0
    return out


def first_branch(proposal: Proposal) -> Proposal:
    """A tree's chain of first children (under a grammar drafts are checked as chains)."""
    tokens, at = [], -1
    for i, parent in enumerate(proposal.parents):
        if parent == at:
            tokens.append(proposal.tokens[i])
            at = i
    return Proposal(tokens, None, proposal.probe)


def settle_round(seq: Sequence, planned: Round, logits: torch.Tensor, hidden: torch.Tensor,
                 pass_s: float) -> list[int]:
    """Verify the draft against the target's (k+1, V) logits of the round, roll the cache back
    to the accepted prefix and emit 1..k+1 tokens. `hidden`: the round's (k+1, ...) rows as the
    drafter observes them (`observed_rows`); `pass_s`: the pass's time."""
    t0 = time.perf_counter()
    verdict = verify(logits, planned, seq)
    kept = roll_back(seq, planned, verdict)
    seq.stats.verify_s += pass_s + time.perf_counter() - t0
    seq.stats.target_passes += 1
    proposed, accepted = count_round(seq, planned, verdict)
    emitted = verdict.emitted(planned.draft)
    if seq.drafter is not None:
        if seq.drafter.wants_hidden:
            seq.drafter.observe(hidden[kept])
        seq.drafter.update(seq.tokens + emitted, max(proposed, 0), accepted)
    return accept_tokens(seq, emitted, from_pass=True)


def roll_back(seq: Sequence, planned: Round, verdict: Verdict | TreeVerdict) -> slice | list[int]:
    """Cut the cache back to the fed last token and the accepted drafts; the round's rows they are.
    A tree's accepted path moves down to where a chain would have put it."""
    kept = slice(0, 1 + verdict.accepted)
    if isinstance(verdict, TreeVerdict):
        seq.cache.keep(seq.slot, [planned.start + 1 + i for i in verdict.path], planned.start + 1)
        kept = [0] + [1 + i for i in verdict.path]
    seq.cache.lengths[seq.slot] = planned.start + 1 + verdict.accepted
    return kept


def count_round(seq: Sequence, planned: Round, verdict: Verdict | TreeVerdict) -> tuple[int, int]:
    """The round's figures into the stats, and the drafter's (proposed, accepted) tokens."""
    # forced tokens are always accepted once reached; the drafter's figures are its own tokens' alone
    proposed = len(planned.draft) - planned.forced - planned.forced_after
    accepted = min(max(verdict.accepted - planned.forced, 0), proposed)
    seq.stats.forced += verdict.accepted - accepted  # those before the drafter's and after
    seq.budget.closing += planned.closing
    if proposed > 0:
        seq.stats.proposed += proposed
        seq.stats.accepted += accepted
        if planned.proposal.probe:
            seq.stats.probe_proposed += proposed
            seq.stats.probe_accepted += accepted
        seq.accept_lengths.append(accepted)
        seq.stats.count_round(proposed, accepted, planned.proposal.parents)
    return proposed, accepted


def decode_round(model: LlamaModel, seq: Sequence, planned: Round) -> list[int]:
    """One target pass for one sequence: verify the round `plan_round` planned and emit 1..k+1
    tokens."""
    t0 = time.perf_counter()
    feed = torch.tensor([[seq.tokens[-1], *planned.draft]])  # (1, k+1)
    taps = taps_for([seq.drafter])
    hidden, tapped = _forward(model, feed, seq, taps, planned.tree_mask())
    logits = model.logits(hidden[0])  # (k+1, V)
    pass_s = time.perf_counter() - t0
    if seq.costs is not None:
        seq.costs.record(len(planned.draft) + 1, pass_s, context=planned.start + len(planned.draft) + 1)
    observed = hidden[0] if seq.drafter is None else observed_rows(seq.drafter, hidden[0], tapped, taps)
    return settle_round(seq, planned, logits, observed, pass_s)


def _forward(model: LlamaModel, feed: torch.Tensor, seq: Sequence, taps: tuple[int, ...],
             tree: TreeMask | None = None, prompt: bool = False):
    """(hidden (1, T, H), tapped row 0 (T, len(taps) * H) or None). `prompt`: prompt rows (bf16 prefill)."""
    extra = {} if tree is None else {"tree": tree}
    if prompt and getattr(model, "prefill_bf16", False):
        extra["prompt"] = True
    if not taps:
        return model.forward(feed, seq.cache, [seq.slot], **extra), None
    hidden, tapped = model.forward(feed, seq.cache, [seq.slot], taps, **extra)
    return hidden, tapped[0]


def verify(logits: torch.Tensor, planned: Round, seq: Sequence) -> Verdict | TreeVerdict:
    """The round's verdict on the target's (k+1, V) logits."""
    verdict = _verify(logits, planned, seq)
    return verdict if not planned.left else within_budget(verdict, logits, planned, seq)


def within_budget(verdict: Verdict, logits: torch.Tensor, planned: Round, seq: Sequence) -> Verdict:
    """A window round's verdict, up to its first token after which the closing no longer fits; that
    one is chosen again among those that fit (greedy: the next best; sampled: drawn again from the
    target without it, so a token that fits comes out with its probability under the target
    restricted to the tokens that fit, whether the verdict drew it or the redraw did)."""
    emitted = verdict.emitted(planned.draft)
    position = len(seq.tokens)
    for j, token in enumerate(emitted):
        with closing.ahead(seq.constraint, emitted[:j]):
            if closing.fits(seq.budget, position + j, token, planned.left - j):
                continue
            # the redraw starts from the grammar's own mask, not one without the misfit: top-p and
            # top-k must keep the target's set (windowed_choice leaves the misfit out itself)
            chosen = budget_choice(logits[j], seq, planned.masks[j], planned.left - j, None, position + j,
                                   TokenDraws.CLOSING)
        return Verdict(j, chosen)
    return verdict


def _verify(logits: torch.Tensor, planned: Round, seq: Sequence) -> Verdict | TreeVerdict:
    proposal, draft = planned.proposal, planned.draft
    if seq.sampling.greedy:  # the target's choices, within the grammar's masks under one
        chosen = greedy_choices(logits, planned.masks)
        if proposal.parents is not None:
            return verify_tree_greedy(chosen, draft, proposal.parents)
        return verify_greedy(chosen, draft)
    q = None if proposal.q is None else proposal.q[: len(draft)]
    if planned.masks is not None:
        # the constrained distributions: target and draft masked alike (the draft's tokens
        # are all allowed: plan_round cut it at the first forbidden one)
        logits = masked_logits(logits, planned.masks)
        q = None if q is None else masked_probs(q, planned.masks[: len(draft)])
    if proposal.parents is not None:
        return verify_tree_sampled(processed_probs(logits, seq.sampling), draft, proposal.parents, seq.draws,
                                   len(seq.tokens))
    return verify_sampled(processed_probs(logits, seq.sampling), q, draft, seq.draws, len(seq.tokens))


def greedy_choices(logits: torch.Tensor, allowed: torch.Tensor | None = None) -> list[int]:
    """Each row's argmax of logits (R, V'), within `allowed` (R, V) where given: the engine's
    kernel where it builds (torch's masked copy and argmax cost about 5 ms on a 12-row verify
    over a 49k vocabulary), else torch. Ties go to the first index either way."""
    kernels = cpu_kernels()
    if kernels is not None:
        return kernels.argmax(logits, allowed)
    if allowed is not None:
        logits = masked_logits(logits, allowed)
    return logits.argmax(dim=-1).tolist()


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


def begin(seq: Sequence) -> None:
    seq.started = time.perf_counter()
    if seq.drafter is not None:
        seq.drafter.start(seq.prompt)
    seq.tokens = list(seq.prompt)


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


def run_sequence(model: LlamaModel, seq: Sequence, cancel: threading.Event | None = None,
                 reused: int = 0) -> Iterator[StreamEvent]:
    """Drive one sequence to the end on its own, yielding text as it is accepted (`reused`: see prefill)."""
    begin(seq)
    tokens = prefill(model, seq, reused)
    seq.stats.ttft_s = time.perf_counter() - seq.started
    planned = None
    while True:
        event = emit(seq, tokens, planned)
        if event is not None:
            yield event
        if seq.finished:
            break
        if cancel is not None and cancel.is_set():
            seq.finish_reason = "cancelled"
            break
        planned = plan_round(seq, seq.spec.gamma)
        preview = preview_forced(seq, planned)
        if preview is not None:
            yield preview
        tokens = decode_round(model, seq, planned)
    yield final_event(seq)


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
