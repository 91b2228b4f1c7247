"""Prompt-lookup drafting: copy what followed the latest earlier occurrence of the current suffix.

An index maps each n-gram (n in [n_min, n_max]) to the positions right after its occurrences,
updated incrementally as tokens arrive, so a proposal costs O(n_max) dictionary lookups rather
than a scan of the context.
"""

from __future__ import annotations

import torch

from openalice_runner.engine.cost_model import PassCostModel
from openalice_runner.engine.drafters.base import Drafter, Proposal
from openalice_runner.engine.types import SamplingParams


class NgramIndex:
    """n-gram -> end position of its latest occurrence (the index of the token after it)."""

    def __init__(self, n_min: int, n_max: int):
        if not (1 <= n_min <= n_max):
            raise ValueError(f"need 1 <= n_min <= n_max, got {n_min}, {n_max}")
        self.n_min, self.n_max = n_min, n_max
        self.tokens: list[int] = []
        self.latest: list[dict[tuple[int, ...], int]] = [{} for _ in range(n_max + 1)]
        self._pending: list[tuple[int, tuple[int, ...], int]] = []

    def extend(self, tokens: list[int]) -> None:
        for token in tokens:
            self.tokens.append(token)
            end = len(self.tokens)
            # The n-grams ending at the newest token must not be visible to the lookup of the
            # suffix they form themselves, so each is published one token later.
            for n, gram, pos in self._pending:
                self.latest[n][gram] = pos
            self._pending = [
                (n, tuple(self.tokens[end - n : end]), end)
                for n in range(self.n_min, self.n_max + 1)
                if end >= n
            ]

    def lookup(self, max_tokens: int) -> list[int]:
        """Tokens that followed the latest earlier occurrence of the longest matching suffix."""
        return self.match(max_tokens)[0]

    def match(self, max_tokens: int) -> tuple[list[int], int]:
        """(continuation, length of the matched suffix); ([], 0) without a match."""
        end = len(self.tokens)
        for n in range(min(self.n_max, end), self.n_min - 1, -1):
            pos = self.latest[n].get(tuple(self.tokens[end - n :]))
            if pos is not None:
                return self.tokens[pos : pos + max_tokens], n
        return [], 0


def find_continuation(context: list[int], n_min: int, n_max: int, max_tokens: int) -> list[int]:
    """Reference search (plain scan, latest occurrence, longest n first), for tests and clarity."""
    for n in range(min(n_max, len(context) - 1), n_min - 1, -1):
        suffix = context[-n:]
        for start in range(len(context) - n - 1, -1, -1):
            if context[start : start + n] == suffix:
                return context[start + n : start + n + max_tokens]
    return []


class AcceptanceByMatch:
    """Per-token acceptance estimate for each matched-suffix length, from the rounds so far.

    alpha = accepted / (accepted + rejections): the maximum-likelihood rate of a geometric
    number of accepted tokens. A weak prior (PRIOR_WEIGHT pseudo-tokens) trusts longer matches
    more; one lucky probe does not outweigh it, a few rounds of evidence do.
    """

    PRIOR_ALPHA = (0.0, 0.25, 0.4, 0.5, 0.6)  # by matched length 1..4; longer: the last value
    PRIOR_WEIGHT = 4.0

    def __init__(self, n_max: int):
        priors = [self.PRIOR_ALPHA[min(n, len(self.PRIOR_ALPHA) - 1)] for n in range(n_max + 1)]
        self.accepted = [a * self.PRIOR_WEIGHT for a in priors]
        self.rejected = [(1 - a) * self.PRIOR_WEIGHT for a in priors]

    def alpha(self, n: int) -> float:
        return self.accepted[n] / (self.accepted[n] + self.rejected[n])

    def expected_accepted(self, n: int, k: int) -> float:
        a = self.alpha(n)
        return k if a >= 1.0 else a * (1 - a**k) / (1 - a)

    def update(self, n: int, proposed: int, accepted: int) -> None:
        self.accepted[n] += accepted
        self.rejected[n] += 1.0 if accepted < proposed else 0.0


class NgramDrafter(Drafter):
    """Prompt lookup that proposes only what it expects to pay for.

    For a match of n tokens with estimated per-token acceptance alpha_n, proposing k tokens
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
        self.acceptance = AcceptanceByMatch(n_max)
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
        self.acceptance = AcceptanceByMatch(self.index.n_max)
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
