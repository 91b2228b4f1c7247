"""Drafting with a smaller causal LM that shares the target's vocabulary.

The draft model keeps its own KV cache. Before proposing it catches up on the tokens it has
not seen (the last round's recovered or bonus token, and accepted drafts it never fed), then
decodes γ tokens one at a time; after verification it rolls its cache back to the accepted
prefix by moving the position pointer.
"""

from __future__ import annotations

import torch

from openalice_runner.engine.drafters.base import Drafter, Proposal
from openalice_runner.engine.kv_cache import KVCache
from openalice_runner.engine.llama import LlamaModel
from openalice_runner.engine.sampling import processed_probs
from openalice_runner.engine.types import SamplingParams


class DraftModelDrafter(Drafter):
    samples = True
    name = "draft"

    def __init__(self, model: LlamaModel, cache: KVCache):
        self.model = model
        self.cache = cache  # one slot, reused across requests by the engine
        self.fed: list[int] = []  # tokens whose keys/values are in the cache, in order
        self._base = 0

    def start(self, prompt: list[int]) -> None:
        self.cache.lengths[0] = 0
        self.fed = []
        self._base = 0

    def propose(self, history: list[int], gamma: int, sampling: SamplingParams,
                generator: torch.Generator | None) -> Proposal:
        # Never feed the full context length: leave room for γ proposals.
        budget = self.cache.max_len - len(history)
        gamma = min(gamma, budget)
        if gamma <= 0:
            return Proposal([])
        self._base = len(history)  # fed == history[:len(fed)] holds from here on
        pending = history[len(self.fed) :]
        tokens: list[int] = []
        rows: list[torch.Tensor] = []
        feed = pending
        for _ in range(gamma):
            hidden = self.model.forward(torch.tensor([feed]), self.cache)
            self.fed.extend(feed)
            logits = self.model.logits(hidden[0, -1])
            if sampling.greedy:
                token = int(logits.argmax())
            else:
                probs = processed_probs(logits, sampling)
                token = int(torch.multinomial(probs, 1, generator=generator).item())
                rows.append(probs)
            tokens.append(token)
            feed = [token]
        # The last proposed token was never fed; it is fed next round if accepted.
        q = torch.stack(rows) if rows else None
        return Proposal(tokens, q)

    def update(self, history: list[int], proposed: int, accepted: int) -> None:
        # Keep the longest prefix of what we fed that is still part of the history; the
        # first `_base` tokens were history already when we proposed.
        keep = min(self._base, len(self.fed))
        limit = min(len(self.fed), len(history))
        while keep < limit and self.fed[keep] == history[keep]:
            keep += 1
        self.fed = self.fed[:keep]
        self.cache.lengths[0] = keep
