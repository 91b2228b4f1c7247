"""EAGLE-style drafting: a small head over the target's own hidden states.

The generator hands the drafter the target's final hidden states of every token it fed and
kept (`observe`). Before proposing, the head catches up on the positions it has not seen: row t
reads (f_t, x_{t+1}); the last such row is at the position of the token before the emitted but
not yet fed one, and its output is the head's guess of that token's feature, whose LM-head
argmax (over the draft vocabulary) is the first draft. Further drafts feed the guessed feature
and the drafted token back in. Head cache entries of drafts are overwritten later (a row
attends only up to its own position), so rolling back costs nothing.

Greedy requests draft the argmax (one-hot q, like n-gram). Sampled requests draw from the
head's processed distribution over the draft vocabulary and report it as q, so rejection
sampling stays exact.

Draft length (as EAGLE-2's dynamic drafts, on a chain): with the engine's pass costs, γ is a
cap. The head's own probability of each drafted token, multiplied along the chain, estimates
the chance that the draft survives that far; the drafter stops where one more draft step and
verify row are expected to cost more than the token they would add, and proposes the prefix
with the most expected tokens per unit of step time (possibly none). The length depends on the
drafter's side alone, so output and sampling stay exact.

Trees (`tree_nodes` > 0): instead of one chain, the head's top candidates at each depth, of
which the best-scored are verified in one pass (`eagle_tree.py`, `engine/tree.py`). γ caps the
depth. Tree drafts are the head's top-k, deterministic, so q is one-hot for sampled requests too.
"""

from __future__ import annotations

import time

import torch

from openalice_runner.engine.cost_model import PassCostModel
from openalice_runner.engine.drafters import eagle_tree
from openalice_runner.engine.drafters.base import Drafter, Proposal, seeded_sampling
from openalice_runner.engine.sampling import processed_probs
from openalice_runner.engine.types import SamplingParams

PRIOR_STEP_COST = 0.07  # one head step relative to a one-row target pass, until measured
STEP_EMA = 0.1


class EagleDrafter(Drafter):
    samples = True
    name = "eagle"
    wants_hidden = True

    def __init__(self, runtime, max_len: int, vocab_size: int | None = None, costs: PassCostModel | None = None,
                 tree_nodes: int = 0):
        """`runtime`: an `EagleRuntime` (or anything with its `new_cache`, `step`, `logits`, `vocab`).
        `costs`: the engine's pass costs; without them every proposal is γ long (a tree, all
        `tree_nodes` tokens). `tree_nodes`: draft trees of up to this many tokens; 0 drafts chains."""
        self.runtime = runtime
        self.tree_nodes = tree_nodes
        self.feature_layers = tuple(getattr(getattr(runtime, "cfg", None), "taps", ()))
        self.vocab_size = vocab_size
        self.costs = costs
        self.cache = runtime.new_cache(max_len)
        self.max_len = self.cache[0].shape[2]
        self.feats: torch.Tensor | None = None  # (capacity, W) target features, row = position
        self.n_feats = 0
        self.seen = 0  # positions whose true rows are in the head's cache
        self._batch, self._rows = 1, 1

    def start(self, prompt: list[int]) -> None:
        self.n_feats = 0
        self.seen = 0

    def step_load(self, batch: int, rows: int) -> None:
        self._batch, self._rows = max(1, batch), max(1, rows)

    def reuse(self, previous: Drafter, tokens: int) -> bool:
        """Adopt a finished drafter's features and head cache for a shared prefix. Features at
        positions below `tokens` depend only on the shared tokens; a head cache row t also reads
        token t+1, so rows up to `tokens` - 2 carry over."""
        if not (isinstance(previous, EagleDrafter) and previous.runtime is self.runtime
                and previous.n_feats >= tokens):
            return False
        self.feats, self.n_feats = previous.feats, tokens
        self.seen = min(previous.seen, tokens - 1)
        if previous.max_len >= self.max_len:
            self.cache, self.max_len = previous.cache, previous.max_len
        else:  # this sequence may run longer: its own cache, with the rows that carry over
            for mine, theirs in zip(self.cache, previous.cache, strict=True):
                mine[:, :, : self.seen] = theirs[:, :, : self.seen]
        previous.feats, previous.n_feats, previous.seen = None, 0, 0  # handed over, not shared
        return True

    def observe(self, hidden: torch.Tensor) -> None:
        rows = hidden.shape[0]
        need = self.n_feats + rows
        if self.feats is None or self.feats.shape[0] < need:
            grown = torch.empty(max(need, 2 * (0 if self.feats is None else self.feats.shape[0]), 256),
                                hidden.shape[-1])
            if self.feats is not None and self.n_feats:
                grown[: self.n_feats] = self.feats[: self.n_feats]
            self.feats = grown
        self.feats[self.n_feats : need] = hidden.float()
        self.n_feats = need

    def _chain_step(self, feat: torch.Tensor, token: int, pos: int) -> torch.Tensor:
        """One draft step of the chain, timed: what a longer draft costs on the drafter's side
        (catch-up steps over many rows would overstate it)."""
        t0 = time.perf_counter()
        out = self.runtime.step(self.cache, feat, [token], [pos])
        _record_step(self.runtime, time.perf_counter() - t0)
        return out

    def propose(self, history: list[int], gamma: int, sampling: SamplingParams,
                generator: torch.Generator | None) -> Proposal:
        last = len(history) - 2  # position of the last fed token; history[-1] is not fed yet
        if last < 0 or self.n_feats != last + 1:
            return Proposal([])  # features out of step (e.g. observe not wired): draft nothing
        gamma = min(gamma, self.max_len - 1 - last)
        if gamma <= 0:
            return Proposal([])
        rt = self.runtime
        start = min(self.seen, last)
        positions = list(range(start, last + 1))
        out = rt.step(self.cache, self.feats[start : last + 1], history[start + 1 : last + 2], positions)
        self.seen = last + 1
        feat = out[-1:]
        # a sampled chain's length decides which streams verification reads: not timed when seeded
        costs = None if seeded_sampling(sampling) and not self.tree_nodes else self.costs
        length = _DraftLength(costs, getattr(rt, "draft_step_s", None), self._batch, self._rows, len(history))
        if self.tree_nodes:
            return self._propose_tree(feat, last, gamma, length)
        tokens: list[int] = []
        rows: list[torch.Tensor] = []
        pos = last + 1
        for i in range(gamma):
            sub = rt.logits(feat)[0]
            if sampling.greedy:
                choice = int(sub.argmax())
                token = int(rt.vocab[choice])
                confidence = float(torch.softmax(sub.float(), -1)[choice]) if length.active else 1.0
            else:
                full = torch.full((self.vocab_size or int(rt.vocab.max()) + 1,), float("-inf"))
                full[rt.vocab] = sub
                probs = processed_probs(full, sampling)
                token = int(torch.multinomial(probs, 1, generator=generator).item())
                rows.append(probs)
                confidence = float(probs[token])
            tokens.append(token)
            if not length.worth_another(confidence) or i + 1 == gamma:
                break
            feat = self._chain_step(feat, token, pos)
            pos += 1
        k = length.best if length.active else len(tokens)
        return Proposal(tokens[:k], torch.stack(rows[:k]) if rows and k else None)

    def _propose_tree(self, feat: torch.Tensor, last: int, depth: int, length: _DraftLength) -> Proposal:
        rt = self.runtime
        t0 = time.perf_counter()
        value = length.tree_value if length.active else None
        nodes, steps = eagle_tree.grow(rt, self.cache, feat, last, depth, self.max_len - 2 - last,
                                       max_nodes=self.tree_nodes, value=value)
        if steps:  # what one head step costs, for this and later drafts' sizing
            _record_step(rt, (time.perf_counter() - t0) / steps)
        tokens, parents = eagle_tree.select(nodes, self.tree_nodes, value)
        return Proposal(tokens, None, parents=parents) if tokens else Proposal([])


def _record_step(runtime, seconds: float) -> None:
    """Fold one head step's time into the runtime's average (shared by the head's requests)."""
    old = getattr(runtime, "draft_step_s", None)
    runtime.draft_step_s = seconds if old is None else old + STEP_EMA * (seconds - old)


class _DraftLength:
    """Expected tokens per unit of step time for each draft length, as the chain grows.

    A step of B decoding sequences and R rows before this draft emits about B tokens for
    cost(R); k drafts surviving with probability c_1 >= c_2 >= ... add sum(c_i) tokens and cost
    k verify rows and k - 1 more head steps (the first draft comes with the catch-up step)."""

    def __init__(self, costs: PassCostModel | None, step_s: float | None, batch: int, rows: int,
                 context: int | None = None):
        single = costs.seconds(1) if costs is not None else None
        # until a plain and a verify pass were timed, draft γ (the verify passes get measured)
        self.active = single is not None and costs.measured_above(1)
        if not self.active:
            return
        self.costs = costs
        self.step_cost = PRIOR_STEP_COST if step_s is None else step_s / single
        self.batch, self.rows, self.context = batch, rows, context
        self.base = costs.ratio(rows, context)
        self.survive = 1.0
        self.expected = 0.0
        self.k = 0
        self.best, self.best_value = 0, 1.0

    def value(self, k: int, expected: float) -> float:
        cost = self.costs.ratio(self.rows + k, self._at(k)) + max(0, k - 1) * self.step_cost
        return ((self.batch + expected) / self.batch) / (cost / self.base)

    def tree_value(self, nodes: int, expected: float, depth: int) -> float:
        """Tokens per unit cost of verifying `nodes` tree nodes expected to accept `expected`
        tokens, reaching `depth` (depth - 1 head steps past the catch-up)."""
        cost = self.costs.ratio(self.rows + nodes, self._at(nodes)) + max(0, depth - 1) * self.step_cost
        return ((self.batch + expected) / self.batch) / (cost / self.base)

    def _at(self, drafts: int) -> int | None:
        """The context of a verify pass with `drafts` more rows (None: any context)."""
        return None if self.context is None else self.context + drafts

    def worth_another(self, confidence: float) -> bool:
        """Record the k-th draft's confidence; True if a (k+1)-th is expected to pay."""
        if not self.active:
            return True
        self.k += 1
        self.survive *= confidence
        self.expected += self.survive
        v = self.value(self.k, self.expected)
        if v > self.best_value:
            self.best, self.best_value = self.k, v
        # the next draft, guessed as sure as this one was
        guess = self.survive * confidence
        return self.value(self.k + 1, self.expected + guess) > self.best_value
