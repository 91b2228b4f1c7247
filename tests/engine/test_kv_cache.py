"""The KV cache's tensors live on mappings of their own (kv_cache.mapped_empty), so a cache that grows
or shrinks gives the old tensors' memory back at once, and malloc keeps its defaults for the passes'
activations (issue 49: a 1 MiB mmap threshold made every prefill pass fault its activations in afresh)."""

from __future__ import annotations

import gc
import mmap

import torch

from openalice_runner.engine.kv_cache import KVCache, mapped_empty
from openalice_runner.engine.llama import LlamaConfig


def _mappings() -> list[tuple[int, int]]:
    with open("/proc/self/maps") as f:
        return [tuple(int(x, 16) for x in line.split()[0].split("-")) for line in f]


def _own_mapping(t: torch.Tensor) -> bool:
    """The tensor's bytes are exactly one mapping of the process (never a slice of malloc's heap)."""
    start, end = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    return any(lo == start and end <= hi < end + mmap.PAGESIZE for lo, hi in _mappings())


def test_a_mapped_tensor_is_a_mapping_of_its_own_and_unmapped_when_freed():
    t = mapped_empty((2, 3, 100, 64), torch.bfloat16)  # 75 KiB: malloc would put it on its heap
    assert t.shape == (2, 3, 100, 64) and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert _own_mapping(t)
    t.fill_(1.5)
    assert float(t.float().sum()) == 1.5 * t.numel()
    start = t.data_ptr()
    del t
    gc.collect()
    assert all(lo != start for lo, _ in _mappings())
    assert mapped_empty((0, 3), torch.float32).shape == (0, 3)


def test_a_caches_tensors_stay_on_their_own_mappings_as_it_grows_and_shrinks():
    cfg = LlamaConfig(n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, hidden=32, intermediate=64, vocab_size=64,
                      eps=1e-5, rope_theta=10000.0, max_positions=256)
    cache = KVCache(cfg, batch=1, max_len=16, dtype=torch.float32)
    cache.keys[0][0, :, :16] = 7.0
    cache.lengths[0] = 16
    cache.grow(2, 64)
    assert all(_own_mapping(t) and t.shape == (2, 2, 64, 8) for t in cache.keys + cache.values)
    assert bool((cache.keys[0][0, :, :16] == 7.0).all())  # what the slot held is kept
    cache.shrink(1, 32)
    assert all(_own_mapping(t) and t.shape == (1, 2, 32, 8) for t in cache.keys + cache.values)
    assert bool((cache.keys[0][0, :, :16] == 7.0).all())
