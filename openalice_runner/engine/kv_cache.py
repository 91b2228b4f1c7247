"""The target's KV cache: keys and values preallocated for its sequence slots, rolled back by
moving a slot's length pointer (llama.py runs the passes that write it)."""

from __future__ import annotations

import math
import mmap
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from openalice_runner.engine.llama import LlamaConfig


def kv_position_bytes(cfg: LlamaConfig, dtype: torch.dtype) -> int:
    """Bytes one cache position takes in one slot: a key and a value per layer and KV head."""
    return 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * dtype.itemsize


def mapped_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised tensor on an anonymous mapping of its own: when the tensor is freed, its
    pages go back to the OS at once, whatever malloc's thresholds.

    The cache grows and shrinks by whole tensors of ever new sizes; from malloc's heap, the freed ones
    fit nothing that comes later and stay resident (deep-tools memory check, 16 MiB threshold: peak
    1,840 MiB against 1,455). Keeping them off the heap leaves malloc its defaults, under which a
    pass's activations are reused from the heap instead of mapped and faulted in afresh each pass."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    # the tensor holds the mapping (frombuffer keeps its buffer alive); freed with it, unmapped
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).view(shape)


class KVCache:
    """Preallocated keys and values for `batch` sequence slots; `lengths[b]` tokens are valid.

    Rolling back a rejected draft is `lengths[b] = n`: the stale entries beyond it are
    overwritten by the next write and never read (attention reads positions up to the query's
    own), so the tensors need no zeroing.
    """

    def __init__(self, cfg: LlamaConfig, batch: int, max_len: int, dtype: torch.dtype):
        shape = (batch, cfg.n_kv_heads, max_len, cfg.head_dim)
        self.keys = [mapped_empty(shape, dtype) for _ in range(cfg.n_layers)]
        self.values = [mapped_empty(shape, dtype) for _ in range(cfg.n_layers)]
        self.lengths = [0] * batch
        self.max_len = max_len
        # keys and values of every layer at one position of one slot: nbytes() = batch * max_len * this
        self.position_bytes = kv_position_bytes(cfg, dtype)

    @property
    def batch(self) -> int:
        return len(self.lengths)

    def grow(self, batch: int, max_len: int) -> None:
        """At least `batch` slots of `max_len` positions, keeping what the slots hold."""
        batch, max_len = max(batch, self.batch), max(max_len, self.max_len)
        if (batch, max_len) == (self.batch, self.max_len):
            return
        # All or nothing: every new tensor is allocated before any is swapped in, so a grow that fails
        # (no memory) leaves the cache exactly as it was, for the scheduler to answer and carry on.
        grown = [
            [mapped_empty((batch, old.shape[1], max_len, old.shape[3]), old.dtype) for old in tensors]
            for tensors in (self.keys, self.values)
        ]
        for tensors, news in zip((self.keys, self.values), grown, strict=True):
            for i, (old, new) in enumerate(zip(tensors, news, strict=True)):
                new[: old.shape[0], :, : old.shape[2]] = old
                tensors[i] = new
        self.lengths += [0] * (batch - self.batch)
        self.max_len = max_len

    def shrink(self, batch: int, max_len: int) -> None:
        """At most `batch` slots of `max_len` positions, keeping what the first slots hold up to
        `max_len` (a server's cache after a load peak: the memory goes back)."""
        batch, max_len = min(batch, self.batch), min(max_len, self.max_len)
        if (batch, max_len) == (self.batch, self.max_len):
            return
        for tensors in (self.keys, self.values):
            for i, old in enumerate(tensors):
                tensors[i] = mapped_empty((batch, old.shape[1], max_len, old.shape[3]), old.dtype)
                tensors[i].copy_(old[:batch, :, :max_len])
        self.lengths = [min(n, max_len) for n in self.lengths[:batch]]
        self.max_len = max_len

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    def keep(self, slot: int, sources: list[int], start: int) -> None:
        """Move the entries at positions `sources` (increasing, each >= its destination) of
        `slot` to `start`, `start` + 1, ...: a draft tree's accepted path, to where a chain
        would have written it."""
        if all(src == start + d for d, src in enumerate(sources)):
            return
        src = torch.tensor(sources)
        dst = slice(start, start + len(sources))
        for tensors in (self.keys, self.values):
            for t in tensors:
                t[slot, :, dst] = t[slot, :, src]
