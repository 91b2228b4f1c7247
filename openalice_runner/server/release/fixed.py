"""fixed:N: N tokens (units.py) an event, whatever each pass produced; the last event, at the end of
the reply, holds what is left together with the stream's last chunk."""

from __future__ import annotations

from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator

from openalice_runner.server.release.units import Atom, Builder, Cutter
from openalice_runner.types import ChatChunk


class Groups:
    """Atoms queued in order and taken N units at a time (markers go with the units they follow)."""

    def __init__(self) -> None:
        self.queue: deque[Atom] = deque()
        self.units = 0
        self.builder = Builder()

    def add(self, atoms: list[Atom]) -> None:
        self.queue.extend(atoms)
        self.units += sum(atom.units for atom in atoms)

    def take(self, n: int) -> list[ChatChunk]:
        """The first n units, with the markers before them."""
        atoms: list[Atom] = []
        taken = 0
        while taken < n:
            atom = self.queue.popleft()
            atoms.append(atom)
            taken += atom.units
        self.units -= taken
        return self.builder.build(atoms)

    def rest(self) -> list[ChatChunk]:
        atoms = list(self.queue)
        self.queue.clear()
        self.units = 0
        return self.builder.build(atoms)

    def markers_only_after(self, n: int) -> bool:
        """Whether the first n units are followed by markers and no unit (then they go together)."""
        seen, markers = 0, False
        for atom in self.queue:
            if seen == n:
                if atom.units:
                    return False
                markers = True
            seen += atom.units
        return markers


async def fixed(chunks: AsyncIterator[ChatChunk], n: int) -> AsyncGenerator[list[ChatChunk], None]:
    cutter, groups = Cutter(), Groups()
    try:
        async for chunk in chunks:
            groups.add(cutter.feed(chunk))
            # a full group followed by markers alone waits: the stream's last chunk goes with it
            while groups.units >= n and not groups.markers_only_after(n):
                yield groups.take(n)
    except Exception:
        # the stream broke: what it had produced still leaves, as in pass mode, then its error
        groups.add(cutter.flush())
        if groups.units:
            yield groups.rest()
        raise
    groups.add(cutter.flush())
    while groups.units > n:
        yield groups.take(n)
    last = groups.rest()
    if last:
        yield last
