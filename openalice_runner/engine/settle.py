"""A round settled on the target's pass: its draft verified (exactly: greedy, sampled, a tree,
within a grammar's masks and the closing window), the cache rolled back to the accepted prefix,
the figures counted, and 1..k+1 tokens emitted."""

from __future__ import annotations

import time

import torch

from openalice_runner.engine import closing
from openalice_runner.engine.choice import budget_choice, greedy_choices
from openalice_runner.engine.grammar_constraint import masked_logits, masked_probs
from openalice_runner.engine.rejection import Verdict, verify_greedy, verify_sampled
from openalice_runner.engine.round import Round
from openalice_runner.engine.sampling import TokenDraws, processed_probs
from openalice_runner.engine.sequence import Sequence, accept_tokens
from openalice_runner.engine.tree import TreeVerdict, verify_tree_greedy, verify_tree_sampled


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
