"""Prompt-lookup drafting: copy what followed the latest earlier occurrence of the current suffix.

An index maps each n-gram (n in [n_min, n_max]) to the positions right after its occurrences,
updated incrementally as tokens arrive, so a proposal costs O(n_max) dictionary lookups rather
than a scan of the context.
"""

from __future__ import annotations

import torch

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
        end = len(self.tokens)
        for n in range(min(self.n_max, end), self.n_min - 1, -1):
            pos = self.latest[n].get(tuple(self.tokens[end - n :]))
            if pos is not None:
                return self.tokens[pos : pos + max_tokens]
        return []


def find_continuation(context: list[int], n_min: int, n_max: int, max_tokens: int) -> list[int]:
    """Reference search (plain scan, latest occurrence, longest n first), for tests and clarity."""
    for n in range(min(n_max, len(context) - 1), n_min - 1, -1):
        suffix = context[-n:]
        for start in range(len(context) - n - 1, -1, -1):
            if context[start : start + n] == suffix:
                return context[start + n : start + n + max_tokens]
    return []


class NgramDrafter(Drafter):
    name = "ngram"

    def __init__(self, n_min: int = 1, n_max: int = 4):
        self.index = NgramIndex(n_min, n_max)

    def start(self, prompt: list[int]) -> None:
        self.index = NgramIndex(self.index.n_min, self.index.n_max)
        self.index.extend(prompt)

    def propose(self, history: list[int], gamma: int, sampling: SamplingParams,
                generator: torch.Generator | None) -> Proposal:
        if len(history) > len(self.index.tokens):
            self.index.extend(history[len(self.index.tokens) :])
        return Proposal(self.index.lookup(gamma))
