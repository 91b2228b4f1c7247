"""A decode round as planned: what the drafter proposes, cut to the room the budget, the context
and the cache leave, and under a grammar the forced tokens around it and the masks along it.

Shapes follow one vocabulary: k, the draft's length (the tokens fed after the last one); k+1, the
round's rows (the last token and the draft); V, the vocabulary.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from openalice_runner.engine import closing
from openalice_runner.engine.drafters.base import Proposal
from openalice_runner.engine.sampling import TokenDraws
from openalice_runner.engine.tree import TreeMask, tree_rows
from openalice_runner.engine.types import SpecConfig

if TYPE_CHECKING:
    from openalice_runner.engine.sequence import Sequence

MAX_FORCED = 16  # grammar-forced tokens drafted in one round (they ride the pass for free)


@dataclass
class Round:
    """One decode round as planned (`plan_round`) and settled (`settle_round`); k: the draft's
    length, V: the vocabulary. What lives across rounds stays on `Sequence`."""

    proposal: Proposal  # what is verified: tokens (k,) (the draft), q (k, V) or None, parents (k,) for a tree
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
