"""The step's one pass of the batching scheduler (batching.py): every running sequence's rows in
order (`PassRows`: T rows, each a token at a slot's cache position), one ragged forward over them,
and what it gives back for each sequence to settle on (`PassOut`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from openalice_runner.engine.cost_model import PassCostModel
from openalice_runner.engine.drafters.base import taps_for
from openalice_runner.engine.kv_cache import KVCache
from openalice_runner.engine.llama import LlamaModel
from openalice_runner.engine.round import Round
from openalice_runner.engine.sequence import Sequence
from openalice_runner.engine.tree import TreeMask, plain_rows, tree_rows

if TYPE_CHECKING:
    from openalice_runner.engine.batch_request import BatchRequest


@dataclass
class SeqRows:
    """What one sequence feeds in a step, and where its rows sit in the pass."""

    request: BatchRequest
    first: int
    count: int
    start: int  # the cache position of its first row
    logits_at: int  # its first row of the pass's logits (where it has any)
    choosing: int  # its last rows that choose a token (all of a round's; one or none of a prompt chunk's)
    round: Round | None = None  # None: a prefill chunk


@dataclass
class PassRows:
    """The rows of a step's one pass, in order, and the plans they belong to."""

    vocab: int  # token ids a row may hold: below this
    plans: list[SeqRows] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    logit_rows: list[int] = field(default_factory=list)  # rows that choose a token: only theirs are computed

    def add(self, request: BatchRequest, fed: list[int], start: int, choosing: int,
            planned: Round | None = None) -> None:
        """`fed` tokens of `request` at cache positions from `start`; the last `choosing` rows choose."""
        check_rows(request.seq, fed, start, self.vocab)
        first, n = len(self.tokens), len(fed)
        self.plans.append(SeqRows(request, first, n, start, len(self.logit_rows), choosing, planned))
        self.logit_rows += range(first + n - choosing, first + n)
        self.tokens += fed
        self.positions += range(start, start + n)
        self.slots += [request.seq.slot] * n

    def subset(self, plans: list[SeqRows]) -> PassRows:
        """The rows of `plans` alone, as a pass of their own."""
        rows = PassRows(self.vocab)
        for plan in plans:
            rows.add(plan.request, self.tokens[plan.first : plan.first + plan.count], plan.start, plan.choosing,
                     plan.round)
        return rows


@dataclass
class PassOut:
    """What the step's pass gives the sequences settling on it."""

    hidden: torch.Tensor  # (T, H): every row's final hidden state
    tapped: torch.Tensor | None  # (T, len(taps) * H): the tapped layers' rows, where a drafter asked
    taps: tuple[int, ...]
    logits: torch.Tensor | None  # (len(logit_rows), V): the rows that choose a token
    pass_s: float


def run_pass(model: LlamaModel, cache: KVCache, rows: PassRows, costs: PassCostModel | None) -> PassOut:
    """The step's one forward pass over every planned row, and the logits of the rows that choose."""
    plans = rows.plans
    tree = tree_mask(plans)
    t0 = time.perf_counter()
    taps = taps_for(plan.request.seq.drafter for plan in plans)
    # only eagle-3 drafters ask for taps, and tree drafters for a mask: other models need not know
    extra = {} if tree is None else {"tree": tree}
    spans = [(plan.first, plan.first + plan.count) for plan in plans if plan.round is None]
    if spans and getattr(model, "prompt_kernels", False):  # prompt rows on their own kernels; decode rows keep their bits
        extra["prompt_spans"] = spans
    feed = torch.tensor(rows.tokens)
    if taps:
        hidden, tapped = model.forward_rows(feed, cache, rows.slots, rows.positions, taps, **extra)
    else:
        hidden, tapped = model.forward_rows(feed, cache, rows.slots, rows.positions, **extra), None
    # logits only where a token is chosen: every decode row, the last row of a finished prefill
    logits = model.logits(hidden[rows.logit_rows]) if rows.logit_rows else None
    pass_s = time.perf_counter() - t0
    if costs is not None and all(plan.round is not None for plan in plans):
        # decode-only steps: what drafters weigh a longer draft against (prefill rows would
        # make a step of few decode rows look dear)
        costs.record(len(rows.tokens), pass_s, context=max(rows.positions) + 1)
    return PassOut(hidden, tapped, taps, logits, pass_s)

def check_rows(seq: Sequence, fed: list[int], start: int, vocab: int) -> None:
    """A sequence's rows, checked before they join a shared pass: a row the pass cannot take would
    fail every sequence in it. Raises (failing this sequence alone) where one is out of range."""
    cache = seq.cache
    if not 0 <= seq.slot < cache.batch:
        raise ValueError(f"slot {seq.slot} is not one of the cache's {cache.batch}")
    if start < 0 or start + len(fed) > cache.max_len:
        raise ValueError(f"rows at positions {start}..{start + len(fed) - 1} are beyond the cache of {cache.max_len}")
    bad = [t for t in fed if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"token ids {bad[:4]} are outside the vocabulary of {vocab}")


def tree_mask(plans: list[SeqRows]) -> TreeMask | None:
    """The pass's mask where a draft tree is in it (every row gets an entry), else None."""
    if all(plan.round is None or plan.round.proposal.parents is None for plan in plans):
        return None
    rows: list[tuple[int, int, int]] = []
    for plan in plans:
        if plan.round is None or plan.round.proposal.parents is None:  # a chain, or a prompt chunk
            rows += plain_rows(plan.start, plan.count)
        else:
            rows += tree_rows(plan.start, plan.round.proposal.parents)
    return TreeMask.from_rows(rows)
