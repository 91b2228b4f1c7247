"""The decode loop: prefill, then rounds of (propose, verify in one target pass, roll back).

Plain decoding is the same round with nothing proposed, so one code path serves every method.
The state of one request lives in `Sequence`; `first_round` and `decode_round` are small
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

import torch

from openalice_runner.engine.cost_model import PassCostModel
from openalice_runner.engine.drafters.base import Drafter, Proposal, observed_rows, taps_for
from openalice_runner.engine.grammar import GrammarConstraint, masked_logits, masked_probs
from openalice_runner.engine.llama import KVCache, LlamaModel
from openalice_runner.engine.rejection import Verdict, verify_greedy, verify_sampled
from openalice_runner.engine.sampling import TokenDraws, processed_probs
from openalice_runner.engine.stopping import TextStream
from openalice_runner.engine.tree import (
    TreeMask,
    TreeVerdict,
    plain_rows,
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


class ContextLengthError(ValueError):
    """The prompt does not fit the model's context window."""


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
    # this round's allowed sets (k+1, V) along the draft, and how many of its tokens were forced
    round_masks: torch.Tensor | None = None
    round_forced: int = 0
    previewed: int = 0  # this round's forced tokens whose text went out before its pass (preview_forced)

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


def first_round(model: LlamaModel, seq: Sequence, reused: int = 0) -> list[int]:
    """Prefill the prompt and emit the reply's first tokens. `reused`: the cache already holds
    the first `reused` prompt tokens' keys and values (prefix reuse; at most all but the last).

    The prompt's last chunk and the first round share one pass: the prompt's last token is the
    round's fed token, so what the grammar forces at the reply's start and what the drafter
    proposes there (an agent's next call often opens as its last one did) are verified by the
    prefill pass itself, a few rows more on a pass of many, instead of waiting for passes of
    their own after it."""
    start = time.perf_counter()
    seq.cache.lengths[seq.slot] = reused
    seq.stats.cached_prompt_tokens = reused
    last = len(seq.prompt) - 1
    fed = reused
    while last - fed > PREFILL_CHUNK:
        prefill_chunk(model, seq, seq.prompt[fed : fed + PREFILL_CHUNK])
        fed += PREFILL_CHUNK
    rest = seq.prompt[fed:last]
    if seq.drafter is not None:
        seq.drafter.step_load(1, len(rest) + 1)  # the draft's rows ride a pass of this many
    planned = plan_round(seq, seq.spec.gamma, first=True)
    if seq.drafter is not None:
        seq.drafter.step_load(1, 1)
    tokens = decode_round(model, seq, planned, prompt_rows=rest)
    seq.stats.prefill_s = time.perf_counter() - start
    return tokens


def prefill_chunk(model: LlamaModel, seq: Sequence, chunk: list[int]) -> None:
    taps = taps_for([seq.drafter])
    hidden, tapped = _forward(model, torch.tensor([chunk]), seq, taps)
    if seq.drafter is not None and seq.drafter.wants_hidden:
        seq.drafter.observe(observed_rows(seq.drafter, hidden[0], tapped, taps))


def round_rows(spec: SpecConfig, constrained: bool) -> int:
    """The most tokens one round drafts after the last one: the drafter's rows, and under a grammar
    the forced tokens before them (with speculation off too). Caches are sized for this."""
    return spec.draft_rows + (MAX_FORCED if constrained and spec.forced_drafts else 0)


def plan_round(seq: Sequence, gamma: int, first: bool = False) -> tuple[Proposal, list[int]]:
    """The drafter's proposal for this round (possibly empty), cut to what the budget and the
    context leave room for; returns it with the draft tokens to feed after the last token (a
    tree's nodes in order). `first`: the round rides the prompt's last prefill pass
    (`first_round`), so a drafter that reads hidden states has none of the prompt yet.

    Under a grammar the draft starts with the tokens the grammar forces (when `spec.forced_drafts`;
    no drafter work, always accepted), the drafter continues from there, and the draft ends at
    the first token the grammar forbids; the masks along it are kept for verification."""
    room_context = seq.context_length - len(seq.tokens)  # cache after the pass holds len + k
    room_budget = seq.sampling.max_tokens - seq.generated
    forced: list[int] = []
    if seq.constraint is not None and seq.spec.forced_drafts:
        forced = seq.constraint.forced(min(MAX_FORCED, room_budget - 1, room_context))
    if first and gamma > 0 and seq.drafter is not None and not seq.drafter.samples:
        # a draft row rides a pass of prompt rows: a lookup drafter may use all the rows a round
        # has room for (the forced tokens' too) and weighs what is worth proposing; a drafter
        # that draws from a model pays per token and keeps its γ
        gamma = max(gamma, round_rows(seq.spec, seq.constraint is not None) - len(forced))
    max_draft = min(gamma, room_budget - 1 - len(forced), room_context - len(forced))
    proposal = Proposal([])
    # a drafter reading hidden states has none for forced tokens not yet fed, nor for a prompt
    # not yet fed: forced only then
    drafting = (seq.drafter is not None and max_draft > 0
                and not ((forced or first) and seq.drafter.wants_hidden))
    if drafting:
        t0 = time.perf_counter()
        generator = None if seq.draws is None else seq.draws.stream(len(seq.tokens), TokenDraws.DRAFT)
        proposal = seq.drafter.propose(seq.tokens + forced, max_draft, seq.sampling, generator)
        seq.stats.draft_s += time.perf_counter() - t0
        # a tree may hold more tokens than γ: they must fit the context and the cache
        room_cache = seq.cache.max_len - len(seq.tokens) - len(forced)
        proposal = proposal.cut(max_draft, min(room_context - len(forced), room_cache))
    if seq.constraint is None:
        return proposal, proposal.tokens
    return constrained_proposal(seq, forced, proposal)


def constrained_proposal(seq: Sequence, forced: list[int], proposal: Proposal) -> tuple[Proposal, list[int]]:
    """Forced tokens, then the drafter's chain (a tree's first branch), cut where the grammar
    forbids a token; the round's masks and forced count are left on `seq`."""
    if proposal.parents is not None:
        proposal = first_branch(proposal)
    tokens = forced + proposal.tokens
    n, seq.round_masks = seq.constraint.walk(tokens)
    seq.round_forced = min(len(forced), n)
    q = proposal.q
    if q is not None:
        onehot = torch.zeros(len(forced), q.shape[-1], dtype=q.dtype)
        onehot[torch.arange(len(forced)), torch.tensor(forced, dtype=torch.long)] = 1.0
        q = torch.cat([onehot, q])[:n]
    return Proposal(tokens[:n], q, proposal.probe), tokens[:n]


def first_branch(proposal: Proposal) -> Proposal:
    """A tree's chain of first children (under a grammar drafts are checked as chains)."""
    tokens, at = [], -1
    for i, parent in enumerate(proposal.parents):
        if parent == at:
            tokens.append(proposal.tokens[i])
            at = i
    return Proposal(tokens, None, proposal.probe)


def round_mask(proposal: Proposal, start: int, prompt_rows: int = 0) -> TreeMask | None:
    """The tree mask of a round whose root is fed at `start`, after `prompt_rows` plain rows of
    prompt in the same pass (None for a chain)."""
    if proposal.parents is None:
        return None
    return TreeMask.from_rows(plain_rows(start - prompt_rows, prompt_rows) + tree_rows(start, proposal.parents))


def settle_round(
    seq: Sequence,
    logits: torch.Tensor,
    hidden: torch.Tensor,
    proposal: Proposal,
    draft: list[int],
    length_before: int,
    pass_s: float,
) -> list[int]:
    """Verify the draft against the target's (k+1, V) logits of the round, roll the cache back
    to the accepted prefix and emit 1..k+1 tokens. `hidden`: the round's (k+1, ...) rows as the
    drafter observes them (`observed_rows`). A tree's accepted path moves down to where a chain
    would have put it."""
    t0 = time.perf_counter()
    verdict = verify(logits, proposal, draft, seq)
    kept = slice(0, 1 + verdict.accepted)
    if isinstance(verdict, TreeVerdict):
        seq.cache.keep(seq.slot, [length_before + 1 + i for i in verdict.path], length_before + 1)
        kept = [0] + [1 + i for i in verdict.path]
    # Roll back: keep the fed last token and the accepted drafts.
    seq.cache.lengths[seq.slot] = length_before + 1 + verdict.accepted
    seq.stats.verify_s += pass_s + time.perf_counter() - t0
    seq.stats.target_passes += 1
    # forced tokens are always accepted; the drafter's figures are its own tokens' alone
    forced = min(seq.round_forced, verdict.accepted)
    seq.stats.forced_tokens += forced
    proposed, accepted = len(draft) - seq.round_forced, verdict.accepted - forced
    seq.round_masks, seq.round_forced = None, 0
    if proposed > 0:
        seq.stats.draft_proposed += proposed
        seq.stats.draft_accepted += accepted
        if proposal.probe:
            seq.stats.probe_proposed += proposed
            seq.stats.probe_accepted += accepted
        seq.accept_lengths.append(accepted)
    emitted = verdict.emitted(draft)
    if seq.drafter is not None:
        if seq.drafter.wants_hidden:
            seq.drafter.observe(hidden[kept])
        seq.drafter.update(seq.tokens + emitted, max(proposed, 0), accepted)
    return accept_tokens(seq, emitted, from_pass=True)


def decode_round(model: LlamaModel, seq: Sequence, planned: tuple[Proposal, list[int]],
                 prompt_rows: list[int] | None = None) -> list[int]:
    """One target pass for one sequence: verify the round `plan_round` planned and emit 1..k+1
    tokens. `prompt_rows` (the first round): prompt tokens still to prefill, fed in the same pass
    before the prompt's last token; the pass's time is then the prefill's, not verification's."""
    proposal, draft = planned
    before = prompt_rows or []
    t0 = time.perf_counter()
    length_before = seq.cache.lengths[seq.slot] + len(before)
    feed = torch.tensor([[*before, seq.tokens[-1], *draft]])
    taps = taps_for([seq.drafter])
    hidden, tapped = _forward(model, feed, seq, taps, round_mask(proposal, length_before, len(before)))
    n = len(before)
    logits = model.logits(hidden[0, n:])  # (k+1, V)
    pass_s = time.perf_counter() - t0
    if seq.costs is not None and prompt_rows is None:
        seq.costs.record(len(draft) + 1, pass_s, context=length_before + len(draft) + 1)
    if seq.drafter is None:
        observed = hidden[0, n:]
    else:
        rows = observed_rows(seq.drafter, hidden[0], tapped, taps)
        if n and seq.drafter.wants_hidden:
            seq.drafter.observe(rows[:n])
        observed = rows[n:]
    return settle_round(seq, logits, observed, proposal, draft, length_before,
                        pass_s if prompt_rows is None else 0.0)


def _forward(model: LlamaModel, feed: torch.Tensor, seq: Sequence, taps: tuple[int, ...],
             tree: TreeMask | None = None):
    """(hidden (1, T, H), tapped row 0 (T, len(taps) * H) or None)."""
    extra = {} if tree is None else {"tree": tree}
    if not taps:
        return model.forward(feed, seq.cache, [seq.slot], **extra), None
    hidden, tapped = model.forward(feed, seq.cache, [seq.slot], taps, **extra)
    return hidden, tapped[0]


def verify(logits: torch.Tensor, proposal: Proposal, draft: list[int], seq: Sequence) -> Verdict | TreeVerdict:
    q = None if proposal.q is None else proposal.q[: len(draft)]
    if seq.round_masks is not None:
        # the constrained distributions: target and draft masked alike (the draft's tokens
        # are all allowed: plan_round cut it at the first forbidden one)
        logits = masked_logits(logits, seq.round_masks)
        q = None if q is None else masked_probs(q, seq.round_masks[: len(draft)])
    if proposal.parents is not None:
        if seq.sampling.greedy:
            return verify_tree_greedy(logits.argmax(dim=-1).tolist(), draft, proposal.parents)
        return verify_tree_sampled(processed_probs(logits, seq.sampling), draft, proposal.parents, seq.draws,
                                   len(seq.tokens))
    if seq.sampling.greedy:
        return verify_greedy(logits.argmax(dim=-1).tolist(), draft)
    return verify_sampled(processed_probs(logits, seq.sampling), q, draft, seq.draws, len(seq.tokens))


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


def preview_forced(seq: Sequence, draft: list[int]) -> StreamEvent | None:
    """The text of this round's forced tokens, sent before the pass that verifies them: the
    grammar allows nothing else there, so the pass accepts them whatever the model says (the
    masked target puts all its mass on each). A tool call's name and opening, JSON keys and
    punctuation thus stream a pass earlier. Stop strings change nothing: one the forced text
    completes ends the reply there whatever the pass says, and the text stream holds back a
    possible beginning of one as always. `emit` leaves the previewed tokens out afterwards."""
    if not seq.round_forced or seq.text.stopped:
        return None
    forced = draft[: seq.round_forced]
    seq.previewed = len(forced)
    delta = seq.text.add(forced)
    return StreamEvent(delta, forced)


def emit(seq: Sequence, tokens: list[int]) -> StreamEvent | None:
    """The stream event for tokens just accepted (None when there is nothing to say), less the
    ones previewed before their pass; a stop string found in the text ends the sequence."""
    if seq.previewed:
        previewed, seq.previewed = seq.previewed, 0
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
    tokens = first_round(model, seq, reused)
    seq.stats.ttft_s = time.perf_counter() - seq.started
    while True:
        event = emit(seq, tokens)
        if event is not None:
            yield event
        if seq.finished:
            break
        if cancel is not None and cancel.is_set():
            seq.finish_reason = "cancelled"
            break
        planned = plan_round(seq, seq.spec.gamma)
        preview = preview_forced(seq, planned[1])
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
    if stats.draft_proposed:
        stats.acceptance_rate = stats.draft_accepted / stats.draft_proposed
    if stats.target_passes:
        stats.mean_tokens_per_pass = seq.emitted_by_passes / stats.target_passes
    if seq.accept_lengths:
        histogram = [0] * (max(seq.accept_lengths) + 1)
        for n in seq.accept_lengths:
            histogram[n] += 1
        stats.accept_length_histogram = histogram
    if stats.total_s > 0:
        stats.tokens_per_second = stats.completion_tokens / stats.total_s
    return GenerationResult(text=seq.text.text, token_ids=list(seq.text.token_ids), stats=stats)


def new_sequence(
    prompt: list[int],
    sampling: SamplingParams,
    spec: SpecConfig,
    drafter: Drafter | None,
    cache: KVCache,
    tokenizer,
    eos_ids: frozenset[int],
    context_length: int,
    slot: int = 0,
    costs: PassCostModel | None = None,
    constraint: GrammarConstraint | None = None,
) -> Sequence:
    if not prompt:
        raise ValueError("prompt is empty")
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
        drafter=drafter if spec.method != "off" else None,
        cache=cache,
        slot=slot,
        text=TextStream(tokenizer, sampling.stop),
        eos_ids=eos_ids,
        context_length=context_length,
        draws=draws,
        costs=costs,
        constraint=constraint,
    )
