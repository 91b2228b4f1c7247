"""What a target pass costs, by the number of rows fed, measured as the engine runs.

Speculation pays only when the tokens a round is expected to emit outweigh the price of
verifying the draft relative to a plain one-row step. On a CPU that price is far from flat
(here a verify pass of 9 rows costs about 2.5 plain steps in bf16), so drafters ask this
model before proposing.
"""

from __future__ import annotations

import threading

PRIOR_RATIO = 2.0  # cost(rows>1)/cost(1) assumed until measured
EMA = 0.2


class PassCostModel:
    def __init__(self) -> None:
        self._seconds: dict[int, float] = {}  # rows -> EMA of seconds per pass
        self._lock = threading.Lock()

    def record(self, rows: int, seconds: float) -> None:
        with self._lock:
            old = self._seconds.get(rows)
            self._seconds[rows] = seconds if old is None else old + EMA * (seconds - old)

    def seconds(self, rows: int = 1) -> float | None:
        """Measured seconds of a pass of `rows` rows (None until one ran)."""
        return self._seconds.get(rows)

    def measured_above(self, rows: int) -> bool:
        """Whether a pass of more than `rows` rows was timed."""
        return any(r > rows for r in self._seconds)

    def ratio(self, rows: int) -> float:
        """cost(rows) / cost(1): from the nearest measured row count at or above `rows`."""
        seconds = self._seconds
        single = seconds.get(1)
        if rows <= 1:
            return 1.0
        if single is None:
            return PRIOR_RATIO
        known = sorted(r for r in seconds if r > 1)
        above = [r for r in known if r >= rows]
        below = [r for r in known if r < rows]
        if above:
            return seconds[above[0]] / single
        if below:
            # beyond what was measured a pass grows about linearly with its rows (compute-bound);
            # assuming it flat would make drafting look free at a batch never seen before
            largest = below[-1]
            return seconds[largest] / single * max(1.0, rows / largest)
        return PRIOR_RATIO
