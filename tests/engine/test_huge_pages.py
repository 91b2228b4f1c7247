"""The packed weights live on mappings advised MADV_HUGEPAGE (engine/huge_pages.py): every pass reads
them whole, and on 4 KiB pages a pass after an idle second ran at a fraction of its speed (issue 49,
docs/benchmarks/2026-12-06-huge-pages.md). Whether the kernel then backs them with huge pages depends
on the system's THP setting and free memory, so these tests check what the runner controls: the
advice on the mapping (the `hg` flag in /proc/self/smaps), alignment, and unchanged results."""

from __future__ import annotations

import mmap
import os

import pytest
import torch

from openalice_runner.engine import Engine
from openalice_runner.engine.huge_pages import ALIGN, HUGE_PAGE, HugePageArena, mapping_of

# Linux with THP built into its kernel (a platform's property, not an install's: skipped elsewhere)
ADVISED = hasattr(mmap, "MADV_HUGEPAGE") and os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled")


NO_THP = "no transparent huge pages here (not Linux, or a kernel without THP): the weights stay on ordinary pages"


def test_the_arena_hands_out_aligned_tensors_that_do_not_overlap():
    arena = HugePageArena(chunk_bytes=4 * HUGE_PAGE)
    sizes = [(1000, torch.bfloat16), (37, torch.float32), (3 * HUGE_PAGE // 2, torch.bfloat16), (5, torch.uint8),
             (5 * HUGE_PAGE, torch.uint8)]  # the last is larger than a chunk: a chunk of its own
    tensors = [arena.empty(n, dtype) for n, dtype in sizes]
    spans = []
    for t, (n, dtype) in zip(tensors, sizes, strict=True):
        assert t.shape == (n,) and t.dtype == dtype and t.is_contiguous()
        assert t.data_ptr() % ALIGN == 0
        spans.append((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()))
    spans.sort()
    assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:], strict=False))
    for i, t in enumerate(tensors):  # each keeps what is written to it
        t.view(torch.uint8).fill_(i + 1)
    assert all(bool((t.view(torch.uint8) == i + 1).all()) for i, t in enumerate(tensors))


@pytest.mark.skipif(not ADVISED, reason=NO_THP)
def test_the_arenas_chunks_start_on_a_huge_page_and_are_advised_huge():
    arena = HugePageArena()
    first = arena.empty(10, torch.bfloat16)
    assert first.data_ptr() % HUGE_PAGE == 0  # a chunk's first 2 MiB can be one huge page
    assert "hg" in mapping_of(first.data_ptr()).flags


@pytest.mark.skipif(not ADVISED, reason=NO_THP)
def test_every_packed_weight_of_a_model_is_on_an_advised_mapping(kernels):
    engine = Engine.tiny_random(dtype="bf16", layers=2)
    model = engine.model
    linears = [lin for layer in model.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    linears.append(model.lm_head)
    assert all(lin.packed is not None for lin in linears)
    assert all("hg" in mapping_of(lin.packed.data.data_ptr()).flags for lin in linears)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_weight_packed_into_the_arena_is_the_same_and_gives_the_same_bits(kernels, dtype):
    torch.manual_seed(0)
    weight = torch.randn(37, 600).to(dtype)  # padded to 40 rows
    x = torch.randn(9, 600)
    plain, arena = kernels.pack(weight), kernels.pack(weight, HugePageArena())
    assert torch.equal(plain.data, arena.data) and (plain.n, plain.n_padded, plain.k) == (arena.n, arena.n_padded, arena.k)
    assert torch.equal(kernels.linear(x, plain), kernels.linear(x, arena))


@pytest.mark.skipif(not ADVISED, reason=NO_THP)
def test_openalice_huge_pages_0_keeps_the_packed_weights_off_the_arena(kernels, monkeypatch):
    monkeypatch.setenv("OPENALICE_HUGE_PAGES", "0")
    model = Engine.tiny_random(dtype="bf16", layers=1).model
    assert "hg" not in mapping_of(model.layers[0].gate_up.packed.data.data_ptr()).flags
