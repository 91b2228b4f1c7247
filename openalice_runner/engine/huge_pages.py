"""Memory on 2 MiB pages for what every pass reads whole: the packed weights.

A pass streams every weight, 270 MB for the default model. On 4 KiB pages that is 69,000 pages;
their translations do not fit the TLB, so each pass walks the page tables as it goes, and after the
machine did something else for a while (an agent's tool ran, another process ran) the walks cost far
more (the tables, presumably, no longer cached): on a 2-core VM a 40-token prefill took 40 ms right
after the last call, 100 ms after one idle second and 180 ms after three, and a C loop read 270 MB
at 7-10 GB/s hot and 2-5 GB/s after 3 idle seconds, 13-15 GB/s either way on 2 MiB pages
(docs/benchmarks/2026-12-06-huge-pages.md).

So the packed weights go in anonymous mappings advised `MADV_HUGEPAGE` before anything touches
them, which the kernel backs with 2 MiB pages whenever the system allows THP on request
(`/sys/kernel/mm/transparent_hugepage/enabled`: `always` or `madvise`); otherwise they are ordinary
pages, as before. The weights are carved from chunks of at least `CHUNK_BYTES` so that weights
smaller than a huge page share them; a chunk's tail past its last used 2 MiB is never touched and
costs no memory.
`OPENALICE_HUGE_PAGES=0` keeps them on malloc's memory (for side-by-side benchmarks:
bench/huge_pages.py).
"""

from __future__ import annotations

import contextlib
import mmap
import os
from dataclasses import dataclass, field

import torch

HUGE_PAGE = 2 << 20
CHUNK_BYTES = 64 << 20
ALIGN = 64  # a cache line: the kernels read weights from their start with full-line loads
DISABLE_ENV = "OPENALICE_HUGE_PAGES"


def enabled() -> bool:
    """False where OPENALICE_HUGE_PAGES says 0, false, no or off."""
    return os.environ.get(DISABLE_ENV, "1").lower() not in ("0", "false", "no", "off")


def huge_mapping(nbytes: int) -> mmap.mmap:
    """An anonymous private mapping of `nbytes`, advised to be backed by huge pages where the OS
    has the advice (untouched: no page is resident until written)."""
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advice = getattr(mmap, "MADV_HUGEPAGE", None)  # Linux only
    if advice is not None:
        with contextlib.suppress(OSError):  # THP compiled out or refused: ordinary pages
            mapping.madvise(advice)
    return mapping


@dataclass(frozen=True)
class Mapping:
    """One mapping of this process as /proc/self/smaps gives it (Linux): what benchmarks and tests read
    to see whether the advice took."""

    start: int
    end: int
    flags: frozenset[str]  # VmFlags: `hg` where advised MADV_HUGEPAGE
    anon_huge_bytes: int  # AnonHugePages: how much of it the kernel backs with huge pages


def mapping_of(address: int) -> Mapping:
    """The mapping that holds `address` (LookupError where none does)."""
    found: dict[str, int | set[str]] | None = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                if found is not None:
                    break
                lo, hi = (int(x, 16) for x in head.split("-"))
                if lo <= address < hi:
                    found = {"start": lo, "end": hi, "flags": set(), "anon_huge_bytes": 0}
            elif found is not None and line.startswith("AnonHugePages:"):
                found["anon_huge_bytes"] = int(line.split()[1]) * 1024
            elif found is not None and line.startswith("VmFlags:"):
                found["flags"] = set(line.split()[1:])
    if found is None:
        raise LookupError(f"no mapping of this process holds {address:#x}")
    return Mapping(found["start"], found["end"], frozenset(found["flags"]), found["anon_huge_bytes"])


@dataclass
class HugePageArena:
    """Hands out uninitialised tensors for the model's lifetime from huge-page mappings. A tensor
    keeps its chunk alive (a view of the chunk's tensor); nothing is ever given back."""

    chunk_bytes: int = CHUNK_BYTES
    _chunk: torch.Tensor | None = field(default=None, repr=False)  # uint8 view of the current mapping
    _used: int = 0

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        nbytes = numel * dtype.itemsize
        start = -(-self._used // ALIGN) * ALIGN
        if self._chunk is None or start + nbytes > self._chunk.numel():
            size = -(-max(self.chunk_bytes, nbytes) // HUGE_PAGE) * HUGE_PAGE
            # a huge page backs only a 2 MiB-aligned 2 MiB of the mapping: one page more, to align
            mapped = torch.frombuffer(huge_mapping(size + HUGE_PAGE), dtype=torch.uint8)  # holds the mapping
            skip = -mapped.data_ptr() % HUGE_PAGE
            self._chunk = mapped[skip : skip + size]
            start = 0
        self._used = start + nbytes
        return self._chunk[start : start + nbytes].view(dtype)
