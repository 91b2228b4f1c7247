"""The embedded provider reports the machine's pass costs by rows with each outcome (issue 49), from
the engine's own timings, so that the policy prices a verify pass on the machine it runs on."""

from __future__ import annotations

from stand_ins.streams import read_all

from openalice_runner.providers.base import CallContext
from openalice_runner.providers.local import EmbeddedConfig, EmbeddedProvider
from openalice_runner.speculation import SpeculationPlan
from openalice_runner.types import ChatRequest

REQUEST = ChatRequest(messages=[{"role": "user", "content": "hi"}], max_tokens=4)


def auto(method: str, gamma: int) -> CallContext:
    """A plan as `gamma: auto` in [1, 4] makes it: the policy may pick up to γ 4, a verify pass of 5 rows."""
    return CallContext(plan=SpeculationPlan(method, gamma, rule="r", gamma_range=(1, 4)))


async def test_the_outcome_carries_the_pass_costs_of_the_row_counts_that_ran():
    # its own engine: the shared tiny engine's cost figures are other tests' too
    p = EmbeddedProvider("local", EmbeddedConfig.model_validate({"type": "local", "tiny_random": True}))
    plain = await p.chat(REQUEST, auto("off", 0))
    # one-row passes alone say nothing of what a verify pass costs
    assert plain.outcome.pass_cost_ratios is None
    # passes of several row counts, at the request's context (its bucket: below 128 tokens)
    p.engine.time_passes(rows=(1, 2, 3, 5, 8, 12), context=8, repeats=1)
    r = await p.chat(REQUEST, auto("ngram", 2))
    ratios = r.outcome.pass_cost_ratios
    # the rows the policy may price (1..γ 4 + 1 measured, and the first measured above, as the engine's
    # model answers for 5 rows): not every row count the engine ever timed
    assert ratios is not None and set(ratios) == {1, 2, 3, 5, 8}
    context = r.usage.prompt_tokens + r.usage.completion_tokens
    assert ratios == p.engine.pass_costs.ratios(5, context) and ratios[1] == 1.0
    assert all(v > 0 for v in ratios.values())
    chunks = await read_all(p.stream(REQUEST, auto("ngram", 2)))
    assert set(chunks[-1].outcome.pass_cost_ratios) == {1, 2, 3, 5, 8}  # a stream's outcome alike
