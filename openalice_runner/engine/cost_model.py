"""What a target pass costs, by the number of rows fed and the context they attend to,
measured as the engine runs.

Speculation pays only when the tokens a round is expected to emit outweigh the price of
verifying the draft relative to a plain one-row step. On a CPU that price is far from flat
(here a verify pass of 9 rows costs about 2.5 plain steps in bf16), so drafters ask this
model before proposing. The price also depends on the context: every row reads the keys and
values of all the tokens before it, so at 900 tokens a 16-row verify costs more plain steps
than at 200. Costs are kept per context bucket (powers of two from 128 tokens) as well as
over all passes; a question about a context is answered from its bucket where that bucket
has timed a one-row pass and a pass of at least as many rows, and from all passes otherwise.
"""

from __future__ import annotations

import threading

PRIOR_RATIO = 2.0  # cost(rows>1)/cost(1) assumed until measured
EMA = 0.2
BUCKET_TOKENS = 128  # contexts below this share the first bucket


def context_bucket(context: int) -> int:
    """0 for contexts below 128 tokens, 1 below 256, 2 below 512, ..."""
    return (max(0, context) // BUCKET_TOKENS).bit_length()


class PassCostModel:
    def __init__(self) -> None:
        self._seconds: dict[int, float] = {}  # rows -> EMA of seconds per pass, all contexts
        self._by_bucket: dict[int, dict[int, float]] = {}  # context bucket -> rows -> EMA
        self._lock = threading.Lock()

    def record(self, rows: int, seconds: float, context: int | None = None) -> None:
        """A timed pass of `rows` rows; `context`: the longest context a row of it attended to."""
        with self._lock:
            tables = [self._seconds]
            if context is not None:
                tables.append(self._by_bucket.setdefault(context_bucket(context), {}))
            for table in tables:
                old = table.get(rows)
                table[rows] = seconds if old is None else old + EMA * (seconds - old)

    def seconds(self, rows: int = 1) -> float | None:
        """Measured seconds of a pass of `rows` rows, over all contexts (None until one ran)."""
        return self._seconds.get(rows)

    def measured_above(self, rows: int) -> bool:
        """Whether a pass of more than `rows` rows was timed."""
        return any(r > rows for r in self._seconds)

    def ratio(self, rows: int, context: int | None = None) -> float:
        """cost(rows) / cost(1): from the nearest measured row count at or above `rows`, at
        `context` where its bucket has that measured, else over all contexts."""
        if rows <= 1:
            return 1.0
        if context is not None:
            bucket = self._by_bucket.get(context_bucket(context), {})
            single = bucket.get(1)
            above = [r for r in bucket if r >= rows]
            if single is not None and above:
                return bucket[min(above)] / single
        return _ratio(self._seconds, rows)


def _ratio(seconds: dict[int, float], rows: int) -> float:
    single = seconds.get(1)
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
