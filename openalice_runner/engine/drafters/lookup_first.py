"""Prompt lookup where the context has a match worth drafting, an EAGLE head everywhere else.

Small models repeat their context and themselves often enough that prompt lookup drafts open
chat about as well as a head trained for half an hour, and on other tokens than the head gets
right: lookup is sure where text is copied, the head where the next words follow from the
meaning. This drafter asks the lookup first (free: a dictionary probe) and takes its draft when
the lookup's own gate expects it to pay; otherwise the head drafts. The head still observes every
kept token, so it never falls behind, and it catches up in one pass when its turn comes.

Each round's proposal is one drafter's, with that drafter's q (one-hot for lookup), so
verification stays exact whichever drafted.
"""

from __future__ import annotations

import torch

from openalice_runner.engine.drafters.base import Drafter, Proposal, seeded_sampling
from openalice_runner.engine.drafters.eagle import EagleDrafter
from openalice_runner.engine.drafters.ngram import NgramDrafter
from openalice_runner.engine.types import SamplingParams


class LookupFirstDrafter(Drafter):
    samples = True
    name = "eagle"
    wants_hidden = True

    def __init__(self, lookup: NgramDrafter, head: EagleDrafter):
        self.lookup = lookup
        self.head = head
        self.feature_layers = head.feature_layers
        self._source: Drafter | None = None  # who drafted the round being verified
        self.rounds = {"lookup": 0, "head": 0}  # rounds each drafted (tests, diagnostics)

    def start(self, prompt: list[int]) -> None:
        self.lookup.start(prompt)
        self.head.start(prompt)
        self._source = None

    def step_load(self, batch: int, rows: int) -> None:
        self.lookup.step_load(batch, rows)
        self.head.step_load(batch, rows)

    def reuse(self, previous: Drafter, tokens: int) -> bool:
        return self.head.reuse(previous.head if isinstance(previous, LookupFirstDrafter) else previous, tokens)

    def observe(self, hidden: torch.Tensor) -> None:
        self.head.observe(hidden)

    def propose(self, history: list[int], gamma: int, sampling: SamplingParams,
                generator: torch.Generator | None) -> Proposal:
        if seeded_sampling(sampling):  # whether the head drafts must not hang on timing
            found = self.lookup.lookup(history, gamma)
        else:
            found = self.lookup.propose(history, gamma, sampling, generator)
        if found.tokens and not found.probe:
            self._source = self.lookup
            self.rounds["lookup"] += 1
            return found
        drafted = self.head.propose(history, gamma, sampling, generator)
        if drafted.tokens or not found.tokens:
            self._source = self.head
            self.rounds["head"] += int(bool(drafted.tokens))
            return drafted
        # The head declined and lookup offers a probe: let it check whether copying came back.
        self._source = self.lookup
        self.rounds["lookup"] += 1
        return found

    def update(self, history: list[int], proposed: int, accepted: int) -> None:
        # Only the drafter whose draft was verified learns from the verdict: the lookup's
        # acceptance per match length must not absorb the head's rounds.
        if self._source is not None:
            self._source.update(history, proposed, accepted)
        self._source = None
