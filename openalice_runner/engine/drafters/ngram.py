"""Prompt-lookup drafting: copy what followed the latest earlier occurrence of the current suffix.

An index maps each n-gram (n in [n_min, n_max]) to the positions right after its occurrences,
updated incrementally as tokens arrive, so a proposal costs O(n_max) dictionary lookups rather
than a scan of the context.

A match is weighed by its agreement: how far back the text before the occurrence equals the text
before now (at least n, looked at up to MATCH_CAP tokens). Inside a copy of a tool result or a
file the agreement runs long and the copy is likely to go on; a 4-gram that merely recurs agrees
for 4 tokens. Of an n_max-gram's latest KEEP_OCCURRENCES occurrences the match takes the one that
agrees furthest back (the latest of those), not merely the latest: the copy under way rather than
the same few tokens somewhere else. The drafter learns acceptance per agreement class
(`AcceptanceByMatch`) and drafts longer where the agreement is long
(docs/benchmarks/2026-12-07-ngram-agreement.md).
"""

from __future__ import annotations

import bisect
from collections import deque

import torch

from openalice_runner.engine.cost_model import PassCostModel
from openalice_runner.engine.drafters.base import Drafter, Proposal
from openalice_runner.engine.types import SamplingParams

MATCH_CAP = 16  # agreement looked at, in tokens: the longest class below starts here
KEEP_OCCURRENCES = 16  # of each n_max-gram, the latest occurrences a match chooses among


class NgramIndex:
    """n-gram -> end position of its latest occurrence (the index of the token after it); for
    n_max-grams, of their latest KEEP_OCCURRENCES occurrences."""

    def __init__(self, n_min: int, n_max: int):
        if not (1 <= n_min <= n_max):
            raise ValueError(f"need 1 <= n_min <= n_max, got {n_min}, {n_max}")
        self.n_min, self.n_max = n_min, n_max
        self.tokens: list[int] = []
        self.latest: list[dict[tuple[int, ...], int]] = [{} for _ in range(n_max)]  # n < n_max
        self.recent: dict[tuple[int, ...], deque[int]] = {}  # n_max-gram -> end positions, oldest first
        self._pending: list[tuple[int, tuple[int, ...], int]] = []

    def extend(self, tokens: list[int]) -> None:
        for token in tokens:
            self.tokens.append(token)
            end = len(self.tokens)
            # The n-grams ending at the newest token must not be visible to the lookup of the
            # suffix they form themselves, so each is published one token later.
            for n, gram, pos in self._pending:
                if n < self.n_max:
                    self.latest[n][gram] = pos
                else:
                    self.recent.setdefault(gram, deque(maxlen=KEEP_OCCURRENCES)).append(pos)
            self._pending = [
                (n, tuple(self.tokens[end - n : end]), end)
                for n in range(self.n_min, self.n_max + 1)
                if end >= n
            ]

    def lookup(self, max_tokens: int) -> list[int]:
        """Tokens that followed the chosen earlier occurrence of the longest matching suffix."""
        return self.match(max_tokens)[0]

    def match(self, max_tokens: int) -> tuple[list[int], int]:
        """(continuation, agreement) for the longest matching suffix; ([], 0) without a match.
        The agreement is the suffix's length n extended backwards while the tokens before the
        occurrence equal those before now, up to MATCH_CAP (or n, if longer). Below n_max the
        latest occurrence serves: where the suffix one token longer occurs nowhere earlier, every
        occurrence of this one agrees for exactly n."""
        end = len(self.tokens)
        for n in range(min(self.n_max, end), self.n_min - 1, -1):
            gram = tuple(self.tokens[end - n :])
            if n < self.n_max:
                pos = self.latest[n].get(gram)
                if pos is not None:
                    return self.tokens[pos : pos + max_tokens], n
            elif gram in self.recent:
                pos, length = self._agrees_furthest(self.recent[gram], n)
                return self.tokens[pos : pos + max_tokens], length
        return [], 0

    def _agrees_furthest(self, occurrences: deque[int], n: int) -> tuple[int, int]:
        """(end position, agreement) of the occurrence agreeing furthest back; the latest on a tie."""
        best_pos, best = 0, -1
        for pos in reversed(occurrences):  # latest first
            length = agreement(self.tokens, pos, n)
            if length > best:
                best_pos, best = pos, length
                if best >= MATCH_CAP:
                    break
        return best_pos, best


def agreement(tokens: list[int], pos: int, n: int) -> int:
    """How many tokens before `pos` equal those before the end, given that the last n do (at most
    max(n, MATCH_CAP))."""
    end, length = len(tokens), n
    while length < MATCH_CAP and pos - length > 0 and tokens[pos - length - 1] == tokens[end - length - 1]:
        length += 1
    return length


def find_match(context: list[int], n_min: int, n_max: int, max_tokens: int) -> tuple[list[int], int]:
    """Reference search (a plain scan), for tests and clarity: the longest n whose suffix occurs
    earlier; of its latest KEEP_OCCURRENCES occurrences the one agreeing furthest back, the latest
    on a tie; (continuation, agreement), or ([], 0)."""
    for n in range(min(n_max, len(context) - 1), n_min - 1, -1):
        starts = [s for s in range(len(context) - n - 1, -1, -1) if context[s : s + n] == context[-n:]]
        if starts:
            length, pos = max((agreement(context, s + n, n), s + n) for s in starts[:KEEP_OCCURRENCES])
            return context[pos : pos + max_tokens], length
    return [], 0


def find_continuation(context: list[int], n_min: int, n_max: int, max_tokens: int) -> list[int]:
    return find_match(context, n_min, n_max, max_tokens)[0]


class AcceptanceByMatch:
    """Per-token acceptance estimate for each class of match length, from the rounds so far.

    A match's length is its agreement (`agreement`; for a cross-request match, its suffix's
    length). alpha = accepted / (accepted + rejections): the maximum-likelihood rate of a
    geometric number of accepted tokens. A weak prior (PRIOR_WEIGHT pseudo-tokens) trusts longer
    matches more; one lucky probe does not outweigh it, a few rounds of evidence do.
    """

    CLASSES = (1, 2, 3, 4, 5, 8, MATCH_CAP)  # a class holds the lengths from its start to the next's
    PRIOR_ALPHA = (0.25, 0.4, 0.5, 0.6, 0.7, 0.8, 0.85)  # by class
    PRIOR_WEIGHT = 4.0

    def __init__(self) -> None:
        self.accepted = [a * self.PRIOR_WEIGHT for a in self.PRIOR_ALPHA]
        self.rejected = [(1 - a) * self.PRIOR_WEIGHT for a in self.PRIOR_ALPHA]

    @classmethod
    def length_class(cls, length: int) -> int:
        return max(0, bisect.bisect_right(cls.CLASSES, length) - 1)

    def alpha(self, length: int) -> float:
        c = self.length_class(length)
        return self.accepted[c] / (self.accepted[c] + self.rejected[c])

    def expected_accepted(self, length: int, k: int) -> float:
        a = self.alpha(length)
        return k if a >= 1.0 else a * (1 - a**k) / (1 - a)

    def update(self, length: int, proposed: int, accepted: int) -> None:
        c = self.length_class(length)
        self.accepted[c] += accepted
        self.rejected[c] += 1.0 if accepted < proposed else 0.0


class NgramDrafter(Drafter):
    """Prompt lookup that proposes only what it expects to pay for.

    For a match of agreement n with estimated per-token acceptance alpha_n, proposing k tokens
    emits 1 + E[accepted] tokens for the price `costs.ratio(k + 1)` of plain steps. The drafter
    proposes the k <= gamma with the best ratio of the two, or nothing where no k beats a plain
    step. In a batch (`step_load`: B sequences, R rows before this draft) the step emits about
    B tokens and k drafts make every sequence wait for R + k rows instead of R, so k must beat
    (B + E[accepted]) / B against cost(R + k) / cost(R): at a large batch drafting has to be
    nearly certain to pay, which is where speculation stops helping throughput.

    A declined match is still probed now and then (every `probe_every`-th time, backing off
    exponentially while probes fail), so the estimate recovers when the output starts copying
    again. Probes are marked as such (`Proposal.probe`), so the policy's α leaves them out.
    """

    name = "ngram"

    MAX_PROBE_INTERVAL = 256

    def __init__(self, n_min: int = 1, n_max: int = 4, costs: PassCostModel | None = None, probe_every: int = 8):
        self.index = NgramIndex(n_min, n_max)
        self.costs = costs
        self.probe_every = probe_every
        self.acceptance = AcceptanceByMatch()
        self._declined = 0
        self._probe_interval = probe_every
        self._probing = False
        self._last_match = 0
        self._batch, self._rows = 1, 1
        self._context = 0  # tokens before the draft: what each verify row attends to

    def step_load(self, batch: int, rows: int) -> None:
        self._batch, self._rows = max(1, batch), max(1, rows)

    def start(self, prompt: list[int]) -> None:
        self.index = NgramIndex(self.index.n_min, self.index.n_max)
        self.index.extend(prompt)
        self.acceptance = AcceptanceByMatch()
        self._declined = 0
        self._probe_interval = self.probe_every

    def propose(self, history: list[int], gamma: int, sampling: SamplingParams,
                generator: torch.Generator | None) -> Proposal:
        found = self.lookup(history, gamma)
        tokens, n = found.tokens, self._last_match
        if not tokens or self.costs is None:
            return found
        k, value = self._best_length(n, len(tokens))
        self._probing = value <= 1.0
        if self._probing:
            self._declined += 1
            if self._declined % self._probe_interval:
                return Proposal([])
            return Proposal(tokens[: min(len(tokens), 2)], probe=True)  # a cheap probe
        return Proposal(tokens[:k])

    def lookup(self, history: list[int], gamma: int) -> Proposal:
        """The longest match's continuation, up to `gamma` tokens, not sized by pass costs."""
        tokens, n = self._match(history, gamma)
        self._context = len(history)
        self._last_match = n
        self._probing = False
        return Proposal(tokens)

    def _match(self, history: list[int], gamma: int) -> tuple[list[int], int]:
        """(continuation of at most `gamma` tokens, matched suffix length); ([], 0) for none."""
        if len(history) > len(self.index.tokens):
            self.index.extend(history[len(self.index.tokens) :])
        return self.index.match(gamma)

    def _best_length(self, n: int, k_max: int) -> tuple[int, float]:
        """The draft length with the most expected tokens per unit of pass cost, and that value
        (relative to drafting nothing, 1.0)."""
        best_k, best = 0, 1.0
        batch, rows = self._batch, self._rows
        base = self.costs.ratio(rows, self._context)
        for k in range(1, k_max + 1):
            gain = (batch + self.acceptance.expected_accepted(n, k)) / batch
            value = gain / (self.costs.ratio(rows + k, self._context + k) / base)
            if value > best:
                best_k, best = k, value
        return best_k, best

    def update(self, history: list[int], proposed: int, accepted: int) -> None:
        if proposed:
            self.acceptance.update(self._last_match, proposed, accepted)
            if self._probing:
                # A failed probe backs off exponentially: on text that does not copy, probing
                # must stay a small fraction of the steps. A successful one resets the interval.
                failed = accepted < proposed
                self._probe_interval = (
                    min(self._probe_interval * 2, self.MAX_PROBE_INTERVAL) if failed else self.probe_every
                )
                self._declined = 0
