"""The batching scheduler's KV cache: its slots, the free ones and the histories they hold, within
the budget.

KV-cache budget (`kv_cache_bytes`): the cache is one rectangle, slots x positions, and grows as
requests write. Each admitted request reserves the positions it may ever need (its prompt, its
whole `max_tokens` reply and a round of drafts, within its context); a waiting request is admitted
only if the cache, with the slot it takes and positions for the longest reservation, stays within
the budget, so the lazy growth while replies are written never passes it. Otherwise it waits, and
the requests behind it wait too (first come, first served), until running requests finish. When
nothing runs, the cache first drops what the held histories keep beyond the budget; a request
whose reservation alone is over the budget then runs on its own.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence as Seq
from typing import Protocol

from openalice_runner.engine.kv_cache import KVCache
from openalice_runner.engine.llama import LlamaModel
from openalice_runner.engine.prefixes import HeldPrefixes
from openalice_runner.engine.round import round_rows
from openalice_runner.engine.sequence import Sequence

logger = logging.getLogger(__name__)

CACHE_GRANULE = 512  # KV caches grow in steps of this many positions


class Running(Protocol):
    """A running request as the cache sees it (batching.BatchRequest)."""

    seq: Sequence
    reserved: int  # cache positions it may ever need (`reservation`)
    prefilling: bool


class CacheSlots:
    def __init__(self, model: LlamaModel, max_batch: int, kv_cache_bytes: int | None):
        self.model = model
        self.max_batch = max_batch
        self.kv_cache_bytes = kv_cache_bytes
        self.cache: KVCache = model.new_cache(0, CACHE_GRANULE)
        self.free: list[int] = []  # least recently freed first
        self.prefixes = HeldPrefixes()  # the free slots' histories (prefix reuse)

    def reset(self) -> None:
        """A fresh, empty cache: nothing it held can be trusted after a fault outside the loop's care."""
        self.cache = self.model.new_cache(0, CACHE_GRANULE)
        self.free = []
        self.prefixes.clear()

    def grow(self, slots: int, positions: int) -> None:
        """The cache grown to `slots` slots of `positions` (all or nothing); new slots join the free list."""
        batch = self.cache.batch
        self.cache.grow(slots, positions)
        self.free += range(batch, self.cache.batch)

    def take(self, seq: Sequence, reuse: bool) -> tuple[int, int]:
        """A free slot for `seq`, and how many of its prompt tokens the slot already holds (`reuse`:
        prefix reuse is on); raises leaving the free slots and histories as they were.

        The slot with the longest usable prefix wins; without one, a slot that holds nothing,
        else the one freed longest ago, so recent histories stay for the calls that follow them."""
        free, held = list(self.free), dict(self.prefixes.slots)
        try:
            best, reused = self.prefixes.best(self.free, seq) if reuse else (None, 0)
            if best is None:
                empty = [slot for slot in self.free if slot not in self.prefixes.slots]
                best = empty[0] if empty else self.free[0]
            self.free.remove(best)
            return best, self.prefixes.take(best, seq, reused)
        except BaseException:
            self.free, self.prefixes.slots = free, held
            raise

    def release(self, seq: Sequence, hold: bool) -> None:
        """`seq` leaves its slot; `hold`: the slot keeps its history for prefix reuse (where it is on;
        a sequence that failed may have had part of its rows written: it holds nothing)."""
        self.free.append(seq.slot)
        if hold:
            self.prefixes.hold(seq, self.cache.lengths[seq.slot])

    def fit(self, reserved: int, running: Seq[Running]) -> int | None:
        """The cache's slots once a request that may need `reserved` positions is admitted, or None
        where the budget cannot take it now. Without a free slot the cache grows by doubling (few
        reallocations, and no memory for slots never used), as far as the budget allows."""
        grows = not self.free
        least = self.cache.batch + grows
        most = min(self.max_batch, max(1, 2 * self.cache.batch)) if grows else self.cache.batch
        if self.kv_cache_bytes is None:
            return most
        # every slot may come to hold the longest reservation: the cache is a rectangle
        positions = max(self.cache.max_len, reserved, *(r.reserved for r in running))
        fitting = self.kv_cache_bytes // (positions * self.cache.position_bytes)
        return min(most, fitting) if fitting >= least else None

    def make_room(self, reserved: int, running: Seq[Running]) -> bool:
        """Shrink the cache towards what the running requests and one that may need `reserved`
        positions need, dropping (or shortening) held histories, where that lets the request in
        or where nothing runs; whether the cache changed."""
        if self.kv_cache_bytes is None:
            return False
        positions = max([reserved, *(r.reserved for r in running)])  # each running slot writes below its own
        in_use = 1 + max((r.seq.slot for r in running), default=-1)
        fitting = self.kv_cache_bytes // (positions * self.cache.position_bytes)
        # alone, one slot stays whatever the budget: the request needs it, and it may hold its prefix
        slots = min(self.cache.batch, max(in_use, fitting, 0 if running else 1))
        if running:
            free_below = any(slot < slots for slot in self.free)
            if slots + (not free_below) > fitting:
                return False  # shrinking would drop histories and still not let it in
        if slots >= self.cache.batch and positions >= self.cache.max_len:
            return False
        before = self.cache.nbytes()
        self.cache.shrink(slots, positions)
        self.free = [slot for slot in self.free if slot < slots]
        self.prefixes.cut(slots, self.cache.max_len)
        logger.debug("KV cache budget: %d -> %d bytes", before, self.cache.nbytes())
        return True

    def reserve(self, running: Seq[Running]) -> None:
        """Grow the cache's positions, a granule at a time, to what this step may write: every decoding
        sequence's tokens and a round of drafts (prefills fit since admission)."""
        need = max((positions_for(r.seq, len(r.seq.tokens)) for r in running if not r.prefilling), default=0)
        if need > self.cache.max_len:
            self.cache.grow(self.cache.batch, granules(need))

    def _kept_shape(self) -> tuple[int, int]:
        """(slots, positions) the held histories need."""
        slots = 1 + max(self.prefixes.slots, default=-1)
        longest = max((len(held.tokens) for held in self.prefixes.slots.values()), default=0)
        return slots, max(CACHE_GRANULE, granules(longest))

    def shrinkable(self) -> bool:
        """Whether the cache is larger than the held histories need."""
        slots, positions = self._kept_shape()
        return self.cache.batch > slots or self.cache.max_len > positions

    def shrink(self) -> None:
        """Give back the cache memory of an idle engine, keeping the held histories (called by
        the scheduler thread, with nothing running)."""
        slots, positions = self._kept_shape()
        before = self.cache.nbytes()
        self.cache.shrink(slots, positions)
        self.free = [slot for slot in self.free if slot < slots]
        logger.debug("idle: KV cache %d -> %d bytes", before, self.cache.nbytes())


def positions_for(seq: Sequence, tokens: int) -> int:
    """Cache positions a sequence of `tokens` tokens needs for its next round (its drafts and the token
    before them), within its context."""
    rows = round_rows(seq.spec, seq.constraint is not None) + 2
    return min(tokens, seq.context_length) + rows


def reservation(seq: Sequence) -> int:
    """Cache positions a sequence may ever need, in granules: its prompt and whole reply, and a round."""
    return granules(positions_for(seq, len(seq.prompt) + seq.sampling.max_tokens))


def granules(positions: int) -> int:
    return -(-positions // CACHE_GRANULE) * CACHE_GRANULE
