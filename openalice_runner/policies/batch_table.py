"""Batch-size rules compiled into tables: one compiler, two consumers.

A policy's rules carry batch ranges. Cut the batch axis where any range starts or ends, and each
piece is covered by the same rules throughout. The embedded engine takes the first covering
rule's γ for the request's method (`SpeculationPlan.per_batch`, looked up at every decode step);
`sglang args` takes the union of the covering rules' γ candidates for a pool
(`--speculative-adaptive-config`, whose keys are the pieces' first batch sizes), and `vllm args`
their largest γ (`num_speculative_tokens_per_batch_size`); both from `routed_to`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from openalice_runner.policies.schema import PlanSpec, Policy

T = TypeVar("T")

Entry = tuple[int, float, T]  # (first batch size, last batch size or inf, item)


def batch_segments(entries: Sequence[Entry[T]]) -> list[tuple[int, list[T]]]:
    """(first batch size, items covering it in entry order) for every piece of the batch axis
    from 1 up; a piece runs until the next one's first size. Neighbouring pieces with the same
    items are merged."""
    starts = {1}
    for lo, hi, _ in entries:
        starts.add(max(1, lo))
        if hi != float("inf"):
            starts.add(int(hi) + 1)
    out: list[tuple[int, list[T]]] = []
    for start in sorted(starts):
        covering = [item for lo, hi, item in entries if lo <= start <= hi]
        if out and _same(out[-1][1], covering):
            continue
        out.append((start, covering))
    return out


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b, strict=True))


def routed_to(policy: Policy, pool: str) -> list[Entry[PlanSpec]]:
    """(first batch size, last batch size or inf, plan) for every rule (and the default) that
    routes to `pool`, in the policy's order."""
    out: list[Entry[PlanSpec]] = []
    for rule in policy.rules:
        if rule.pool == pool:
            b = rule.match.batch_size
            lo = b.min if b else 1
            hi = b.max if b and b.max is not None else float("inf")
            out.append((lo, hi, rule))
    if policy.default.pool == pool:
        out.append((1, float("inf"), policy.default))
    return out
