"""Drafters with a known answer, for greedy-equality tests."""

from __future__ import annotations

from openalice_runner.engine.drafters.base import Drafter, Proposal


class OracleDrafter(Drafter):
    """Proposes the reference continuation (all accepted) or a wrong token (all rejected)."""

    def __init__(self, prompt_len: int, reference: list[int], vocab: int, accept: bool):
        self.prompt_len, self.reference, self.vocab, self.accept = prompt_len, reference, vocab, accept

    def propose(self, history, gamma, sampling, generator):
        done = len(history) - self.prompt_len
        upcoming = self.reference[done : done + gamma]
        if not self.accept:
            upcoming = [(t + 1) % self.vocab for t in upcoming]
        return Proposal(upcoming)
