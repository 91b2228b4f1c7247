"""The drafter interface: propose γ tokens with their draft probabilities; learn from the verdict.

Shaped after transformers' candidate generators (`get_candidates` / `update_candidate_strategy`),
with one drafter instance per sequence so that drafters may keep per-sequence state (an
n-gram index, a draft model's KV cache).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from openalice_runner.engine.types import SamplingParams


@dataclass
class Proposal:
    tokens: list[int]
    # (len(tokens), V) processed draft probabilities; None means the draft was chosen
    # deterministically and q is one-hot at each proposed token.
    q: torch.Tensor | None = None
    # An exploratory draft, proposed against the drafter's own estimate that it will not pay, to
    # notice when the text starts copying again. The adaptive policy leaves probes out of the α
    # it learns: α describes the drafts the drafter stands behind.
    probe: bool = False
    # A draft tree (engine/tree.py): parents[i] is the index of token i's parent, -1 for a child
    # of the root, every parent before its children; q is then None (top-k drafts are one-hot).
    # None: the tokens are a chain.
    parents: list[int] | None = None

    def cut(self, max_depth: int, max_nodes: int) -> Proposal:
        """The proposal within `max_depth` tokens of the root and `max_nodes` tokens in all
        (a chain keeps its first min(max_depth, max_nodes) tokens)."""
        if self.parents is None:
            k = max(0, min(max_depth, max_nodes))
            return Proposal(self.tokens[:k], None if self.q is None else self.q[:k], self.probe)
        from openalice_runner.engine.tree import depths

        index: dict[int, int] = {}
        tokens: list[int] = []
        parents: list[int] = []
        for i, (parent, depth) in enumerate(zip(self.parents, depths(self.parents), strict=True)):
            if depth > max_depth or len(tokens) >= max_nodes:
                continue  # its children go too: their depth is larger, or they come later
            index[i] = len(tokens)
            tokens.append(self.tokens[i])
            parents.append(-1 if parent < 0 else index[parent])
        return Proposal(tokens, None, self.probe, parents)


class Drafter(ABC):
    name: str = "drafter"
    # Drafters that read the target's hidden states (EAGLE-style heads) set this, and then get
    # `observe` calls; the others cost nothing extra.
    wants_hidden: bool = False
    # Target layers (indices) whose residual stream the drafter also reads (EAGLE-3 fuses low,
    # middle and high layers): `observe` then gets those, in this order, before the final state.
    feature_layers: tuple[int, ...] = ()
    # Drafters that draw their drafts from their own distribution when the request samples (q is
    # not one-hot). A seeded request then drafts γ tokens every round, whatever the load: how
    # many drafts a round drew decides which streams its verification reads, and so the output.
    samples: bool = False

    def start(self, prompt: list[int]) -> None:  # noqa: B027 - optional hook
        """Called once with the prompt before the first proposal."""

    @abstractmethod
    def propose(self, history: list[int], gamma: int, sampling: SamplingParams,
                generator: torch.Generator | None) -> Proposal:
        """Up to `gamma` tokens to follow `history` (prompt + generated tokens so far)."""

    def step_load(self, batch: int, rows: int) -> None:  # noqa: B027 - optional hook
        """Called by the batching scheduler before `propose`: `batch` sequences decode in this
        step and `rows` rows are in it before this sequence drafts. Drafters that weigh a
        draft's length against the pass's cost use it; alone, a sequence has (1, 1)."""

    def update(self, history: list[int], proposed: int, accepted: int) -> None:  # noqa: B027
        """Called after verification; `history` now holds the emitted tokens too."""

    def reuse(self, previous: Drafter, tokens: int) -> bool:
        """Prefix reuse, for drafters that read hidden states: take over what `previous` (the
        drafter of a finished sequence whose first `tokens` tokens this one's prompt shares)
        holds for those positions, before any `observe`. False: it cannot, and the prompt is
        prefilled in full so that this drafter observes every position."""
        return False

    def observe(self, hidden: torch.Tensor) -> None:  # noqa: B027 - optional hook
        """Only where `wants_hidden`: the target's final hidden states (rows, H), what its LM head
        reads, at the tokens it was just fed and kept: the prompt after each prefill chunk, then
        each round's input token and accepted drafts. Called before `update`. With
        `feature_layers`, rows are (rows, (len(feature_layers) + 1) * H): see `observed_rows`."""


def seeded_sampling(sampling: SamplingParams) -> bool:
    """A sampled request with a seed: drafters that draw their drafts (`Drafter.samples`) size
    them without the measured pass costs, which vary from run to run."""
    return not sampling.greedy and sampling.seed is not None


def taps_for(drafters) -> tuple[int, ...]:
    """The target layers a pass must tap for these drafters (None entries allowed)."""
    return tuple(sorted({i for d in drafters if d is not None and d.wants_hidden for i in d.feature_layers}))


def observed_rows(drafter: Drafter, hidden: torch.Tensor, tapped: torch.Tensor | None,
                  taps: tuple[int, ...]) -> torch.Tensor:
    """What `drafter` observes of a pass: its own tapped layers (from the pass's `taps`), then
    the final hidden state."""
    if not drafter.feature_layers:
        return hidden
    h = hidden.shape[-1]
    parts = [tapped[..., taps.index(i) * h : (taps.index(i) + 1) * h] for i in drafter.feature_layers]
    return torch.cat([*parts, hidden], dim=-1)
