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


class Drafter(ABC):
    name: str = "drafter"

    def start(self, prompt: list[int]) -> None:  # noqa: B027 - optional hook
        """Called once with the prompt before the first proposal."""

    @abstractmethod
    def propose(self, history: list[int], gamma: int, sampling: SamplingParams,
                generator: torch.Generator | None) -> Proposal:
        """Up to `gamma` tokens to follow `history` (prompt + generated tokens so far)."""

    def update(self, history: list[int], proposed: int, accepted: int) -> None:  # noqa: B027
        """Called after verification; `history` now holds the emitted tokens too."""
