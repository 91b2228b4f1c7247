"""The embedded engine's drafting rounds as vLLM runs them, to set the two engines' acceptance side
by side with the same head on the same prompt tokens (issue 47).

vLLM drafts K tokens at every step, however few the request has left of max_tokens ("we don't
schedule partial draft tokens", v1/core/sched/scheduler.py), and counts their acceptance before the
reply is cut at max_tokens; the embedded engine drafts only what fits the budget (round.py). So the
embedded run here gets K more tokens of budget, every round vLLM runs is a full one in it too, and
the rounds past vLLM's end are left out.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from openalice_runner.engine import Engine, SamplingParams, SpecConfig
from openalice_runner.engine.drafters.eagle import EagleDrafter


class _Recorded(EagleDrafter):
    """The head's drafter, keeping each round's (drafted, accepted) in order."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.rounds: list[tuple[int, int]] = []

    def update(self, history: list[int], proposed: int, accepted: int) -> None:
        super().update(history, proposed, accepted)
        self.rounds.append((proposed, accepted))


@dataclass
class Rounds:
    """Rounds of chains of `k` drafts, as vLLM counts them (`spec_decode_num_drafts` and
    `num_accepted_tokens_per_pos`)."""

    k: int
    accepted: list[int] = field(default_factory=list)  # per round, drafts accepted (0..k)
    drafted: set[int] = field(default_factory=set)  # draft lengths seen: {k} where every round was full

    def per_position(self) -> list[float]:
        """Accepted at draft position i / rounds, for i = 1..k."""
        n = max(1, len(self.accepted))
        return [sum(a > i for a in self.accepted) / n for i in range(self.k)]


def vllm_rounds(engine: Engine, head: str | Path, prompt: list[int], max_tokens: int, rounds: Rounds) -> list[int]:
    """Greedy, chains of `rounds.k` drafts: the reply's tokens (at most max_tokens); the rounds vLLM
    would run for it are added to `rounds`."""
    k = rounds.k
    drafter = _Recorded(engine.eagle_runtime(str(head)), len(prompt) + max_tokens + 4 * k, engine.model.cfg.vocab_size)
    out = engine.generate(prompt, SamplingParams(max_tokens=max_tokens + k),
                          SpecConfig(method="eagle", gamma=k, eagle_head=str(head), adaptive_length=False),
                          drafter=drafter)
    generated = 1  # the first token is the prefill's
    for drafted, accepted in drafter.rounds:
        if generated >= max_tokens:  # vLLM has finished the request
            break
        rounds.drafted.add(drafted)
        rounds.accepted.append(accepted)
        generated += accepted + 1
    return out.token_ids[:max_tokens]
