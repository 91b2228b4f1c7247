"""A request's `seed` fixes its output: the same request with the same seed gives the same token
ids alone, repeated, or batched with another request, for every speculation setting.

Each sampled token draws from its own stream, derived from the seed and the token's position
(`sampling.TokenDraws`), so neither the other rows of a batched pass nor how long this round's
draft was (the n-gram drafter sizes drafts by measured pass costs and the batch's load) moves
what a later token draws.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from stand_ins.engines import tiny_engine

from openalice_runner.engine import SamplingParams, SpecConfig
from openalice_runner.engine.drafters.base import Drafter, Proposal
from openalice_runner.speculation import GammaTable

PROMPT = "one two three four five one two three four five one two three"
OTHER = "def f(x):\n    return x + 1\n\ndef g(x):\n    return"
# as the policy's tables do: shorter drafts when more sequences share a pass
SHORTER_IN_A_BATCH = GammaTable(((1, 4), (2, 1)))
SPECS = {
    "off": SpecConfig(method="off"),
    "ngram": SpecConfig(method="ngram", gamma=4, per_batch=SHORTER_IN_A_BATCH),
    "draft": SpecConfig(method="draft", gamma=3, draft_layers=1, per_batch=SHORTER_IN_A_BATCH),
}


class GuessDrafter(Drafter):
    """A one-hot drafter that guesses the last token again, γ times (γ from the batch's size): on the
    random model its drafts are rejected, and how many it drafted varies with the batch."""

    def propose(self, history, gamma, sampling, generator):
        return Proposal([history[-1]] * gamma)


def run(engine, spec, sampling, prompt=PROMPT, guess=False):
    drafter = GuessDrafter() if guess else None
    return engine.generate(engine.encode(prompt), sampling, spec, drafter=drafter).token_ids


def run_beside(engine, spec, sampling, guess=False):
    """The request batched with another (unseeded, sampled) one, both submitted at once."""
    start = threading.Barrier(2)
    other = SamplingParams(temperature=1.0, max_tokens=40)

    def one(job):
        start.wait()
        return run(engine, *job)

    with ThreadPoolExecutor(2) as pool:
        mine, _ = pool.map(one, [(spec, sampling, PROMPT, guess), (SPECS["ngram"], other, OTHER)])
    return mine


@pytest.mark.parametrize("method", [*sorted(SPECS), "one-hot guesses"])
def test_same_seed_same_tokens_alone_repeated_and_batched(method):
    engine = tiny_engine()
    guess = method == "one-hot guesses"
    spec = SPECS["ngram" if guess else method]
    sampling = SamplingParams(temperature=1.0, seed=7, max_tokens=40)
    alone = [run(engine, spec, sampling, guess=guess) for _ in range(3)]
    batched = run_beside(engine, spec, sampling, guess=guess)
    assert len(alone[0]) > 10
    assert alone[1] == alone[0] and alone[2] == alone[0]
    assert batched == alone[0]


def test_other_seeds_and_no_seed_draw_other_samples():
    engine = tiny_engine()
    spec = SPECS["off"]
    seven = run(engine, spec, SamplingParams(temperature=1.0, seed=7, max_tokens=40))
    eight = run(engine, spec, SamplingParams(temperature=1.0, seed=8, max_tokens=40))
    unseeded = [run(engine, spec, SamplingParams(temperature=1.0, max_tokens=40)) for _ in range(2)]
    assert seven != eight
    assert unseeded[0] != unseeded[1]


def test_one_hot_drafts_do_not_move_the_sample():
    """Exact verification of a deterministic draft is coupled to the plain draw: the token at a
    position is the target's own sample for it, accepted when the draft guessed it. So n-gram
    speculation emits what plain decoding emits for the same seed, whatever it drafted."""
    engine = tiny_engine()
    sampling = SamplingParams(temperature=1.0, seed=11, max_tokens=40)
    plain = run(engine, SPECS["off"], sampling)
    assert run(engine, SPECS["ngram"], sampling) == plain
    assert run(engine, SPECS["ngram"], sampling, guess=True) == plain
