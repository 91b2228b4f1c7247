"""Which of a row's repeated runs the benchmarks keep, and what to call it.

With an odd number of runs the kept run is the true median. With an even number there is no middle
run, and averaging two runs would report an output neither produced, so every benchmark keeps the
slower of the two middle runs (the conservative one) and names the row for it: `bench`,
`bench-loops` and `bench-follow-up` (keyed on seconds) and `bench-concurrency` (keyed on
throughput) alike.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")


def kept_run(runs: Sequence[T], seconds: Callable[[T], float] | None = None,
             throughput: Callable[[T], float] | None = None) -> T:
    """The median run of an odd count, the slower middle run of an even one. Give how slow a run
    was (`seconds`, more is slower) or how fast (`throughput`, more is faster), not both."""
    if not runs:
        raise ValueError("no runs to keep one of")
    if (seconds is None) == (throughput is None):
        raise ValueError("give exactly one of seconds= or throughput=")
    # slowest last: index n // 2 is the median for odd n, the slower of the two middle ones for even n
    ordered = sorted(runs, key=seconds) if seconds else sorted(runs, key=throughput, reverse=True)
    return ordered[len(ordered) // 2]


def kept_label(n: int) -> str:
    """What a row of `n` repeats holds, as reports and tables name it."""
    if n < 1:
        raise ValueError(f"repeat must be at least 1, got {n}")
    if n == 1:
        return "single run"
    if n % 2:
        return f"median of {n}"
    return f"slower middle of {n}"


REPEAT_HELP = ("runs per row, taken in turns; the row keeps the median for an odd count and the slower of the "
               "two middle runs for an even one (the report's `kept` says which)")
