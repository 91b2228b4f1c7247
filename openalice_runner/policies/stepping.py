"""Per-step γ for a batched engine: the policy asked again at every decode step.

A request's method is fixed when it starts (its drafter holds state); its γ follows the batch
as it grows and shrinks. The rule matching the current batch size decides: `off` (or another
method than the request's) drafts nothing this step, the request's own method takes that
rule's γ.
"""

from __future__ import annotations

from collections.abc import Callable

from openalice_runner.policies.decision import RequestContext


def step_gamma(
    policy, method: str, turn_type: str, provider: str | None = None, model: str | None = None
) -> Callable[[int, int], int]:
    """`policy`: anything with `decide(RequestContext)` (a PolicyStore). Returns
    (batch size, queue depth) -> γ for this step."""
    contexts: dict[int, RequestContext] = {}

    def gamma(batch: int, waiting: int) -> int:
        # waiting requests join the batch within a step or two: decide for the batch they make
        size = max(1, batch + waiting)
        context = contexts.get(size)
        if context is None:
            context = contexts[size] = RequestContext(
                turn_type=turn_type, batch_size=size, provider=provider, model=model
            )
        decision = policy.decide(context)
        return decision.gamma if decision.method == method else 0

    return gamma
