"""Prefix reuse, for both drivers: the histories that free cache slots still hold, and which one a
new request takes.

An agent loop sends its whole history again with every call, and on a CPU prefill is
compute-bound. A finished sequence's slot keeps its keys and values until the slot is needed; a
new request takes the free slot that holds the longest prefix of its prompt and prefills only the
rest (the cache rows of a position depend only on the tokens up to it, so reusing them is exact).
Only a request of the finished one's tenant reuses its prefix: a prefill cut short tells the
caller that someone sent that prefix before (a time-to-first-token channel), so nothing is reused
across tenants. Drafters that read the target's hidden states (EAGLE heads) take over the finished
sequence's drafter state for the shared positions (`Drafter.reuse`); where they cannot, the prompt
is prefilled in full.

The batching scheduler (batching.py) holds a history per free slot; the serial loop (engine.py)
one, in its one slot, without its drafter (so a drafter that reads hidden states prefills in full).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from openalice_runner.engine.drafters.base import Drafter
from openalice_runner.engine.sequence import Sequence


@dataclass
class Held:
    """What a free slot holds: the tokens whose keys and values sit at positions 0..n-1, whose
    request left them, and the drafter that read their hidden states (None for the others)."""

    tokens: list[int]
    tenant: str | None
    drafter: Drafter | None = None


class HeldPrefixes:
    def __init__(self) -> None:
        self.slots: dict[int, Held] = {}  # free slot -> its history

    def hold(self, seq: Sequence, cache_length: int, drafter: bool = True) -> None:
        """`seq` leaves its slot, whose cache is `cache_length` long; `drafter`: keep its drafter
        for the next request to take over (where it reads hidden states)."""
        # Positions below both the cache length and the token count hold these tokens' entries
        # (the cache may also hold accepted drafts cut off by max_tokens or EOS).
        tokens = seq.tokens[: min(cache_length, len(seq.tokens))]
        keep = drafter and seq.drafter is not None and seq.drafter.wants_hidden
        self.slots[seq.slot] = Held(tokens, seq.tenant, seq.drafter if keep else None)

    def best(self, free: Iterable[int], seq: Sequence) -> tuple[int | None, int]:
        """The free slot that holds the longest usable prefix of `seq`'s prompt, and its length
        (None, 0: none does). Another tenant's history is never used."""
        limit = len(seq.prompt) - 1  # the last prompt token is always fed: its logits start the reply
        best, reused = None, 0
        for slot in free:
            held = self.slots.get(slot)
            if held is None or held.tenant != seq.tenant:
                continue
            n = common_prefix(held.tokens, seq.prompt, limit)
            if n > reused:
                best, reused = slot, n
        return best, reused

    def take(self, slot: int, seq: Sequence, reused: int) -> int:
        """`seq` takes `slot`, whose history leaves it; how many prompt tokens it reuses: `reused`,
        or 0 where its drafter reads hidden states and cannot take over the held one's."""
        held = self.slots.pop(slot, None)
        if reused and seq.drafter is not None and seq.drafter.wants_hidden:
            # it must know the hidden states of the positions it will not observe
            previous = None if held is None else held.drafter
            adopted = previous is not None and seq.drafter.reuse(previous, reused)
            reused = reused if adopted else 0
        return reused

    def cut(self, slots: int, positions: int) -> None:
        """The cache shrank to `slots` slots of `positions`: what no longer fits is dropped."""
        self.slots = {slot: Held(held.tokens[:positions], held.tenant, held.drafter)
                      for slot, held in self.slots.items() if slot < slots}

    def clear(self) -> None:
        self.slots = {}


def common_prefix(held, prompt: list[int], limit: int) -> int:
    """How many leading tokens `held` and `prompt` share, at most `limit`."""
    n = min(len(held), limit)
    for i in range(n):
        if held[i] != prompt[i]:
            return i
    return max(n, 0)
