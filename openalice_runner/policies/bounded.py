"""A least-recently-used map of bounded size, for what is keyed by strings a client chooses.

A request's turn type and model name are the client's: a table keyed by them grows with every new
name (30 model names of 4 MB kept 116 MB for good). Past `max_entries` the least recently used
entry goes; `evicted` counts them.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable
from typing import Generic, TypeVar

V = TypeVar("V")

MAX_ENTRIES = 1024  # per table: far above the turn types x providers x models a deployment serves


class BoundedCache(Generic[V]):
    def __init__(self, max_entries: int = MAX_ENTRIES) -> None:
        self.max_entries = max_entries
        self.evicted = 0
        self._data: OrderedDict[Hashable, V] = OrderedDict()
        self._lock = threading.Lock()  # held for a dict operation or two: decisions never wait long

    def get(self, key: Hashable) -> V | None:
        with self._lock:
            value = self._data.get(key)
            if value is not None:
                self._data.move_to_end(key)
            return value

    def put(self, key: Hashable, value: V) -> None:
        with self._lock:
            self._data[key] = value
            self._data.move_to_end(key)
            while len(self._data) > self.max_entries:
                self._data.popitem(last=False)
                self.evicted += 1

    def __len__(self) -> int:
        return len(self._data)
