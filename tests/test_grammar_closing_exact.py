"""Exactness of speculative sampling under a grammar and a budget that cuts (engine/closing.py).

The grammar is an automaton over a Markov chain's tokens whose state is the last token; only
state 0 is accepting, so a reply must end there within max_tokens. The budget-and-grammar-masked
target at a position with `left` tokens left: the grammar's row (temperature, top-p), restricted
to the tokens t from which an accepting state is reachable in `left - 1` tokens, renormalised
(where top-p kept none of those, the closing path's token).
The reference computes those distances by breadth-first search, independently of the engine's
closing search (which is greedy; on this automaton its lowest allowed token is on a shortest
path, so the two agree). A chi-square test compares sampled replies with the exact joint, for
drafts of several lengths, forced drafts on and off; the same test fails when the closing is
drawn without the budget mask, or when a window token that does not fit is replaced by the
closing path's instead of drawn again.
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch
from stand_ins.markov import (
    PROMPT,
    VOCAB,
    MarkovDrafter,
    MarkovModel,
    SilentTokenizer,
    ToyCache,
    chi_square_p,
    random_chain,
)

from openalice_runner.engine import closing
from openalice_runner.engine.generator import new_sequence, run_sequence
from openalice_runner.engine.grammar import GrammarConstraint
from openalice_runner.engine.sampling import processed_probs
from openalice_runner.engine.types import SamplingParams, SpecConfig

N = 2500
LENGTH = 5
ACCEPTING = {0}
# after 2 only 1 (a forced token); from 1 and 3 one token back to 0; from 2 two; 0 may stay
ROWS = torch.tensor([[True, True, True, True],
                     [True, False, True, True],
                     [False, True, False, False],
                     [True, False, True, False]])


def distances() -> list[int]:
    """Tokens from each state to an accepting one (breadth-first, backwards)."""
    dist = [0 if s in ACCEPTING else None for s in range(VOCAB)]
    frontier = list(ACCEPTING)
    while frontier:
        nxt = []
        for s in range(VOCAB):
            if dist[s] is None and any(bool(ROWS[s, t]) and t in frontier for t in range(VOCAB)):
                dist[s] = dist[frontier[0]] + 1
                nxt.append(s)
        frontier = nxt
    return dist


class Automaton:
    """The LLMatcher methods GrammarConstraint and the closing search call."""

    def __init__(self, start: int):
        self.states = [start]

    def is_stopped(self):
        return False

    def is_accepting(self):
        return self.states[-1] in ACCEPTING

    def is_error(self):
        return False

    def get_error(self):
        return ""

    def compute_ff_tokens(self):
        out, state = [], self.states[-1]
        while len(out) < 8 and int(ROWS[state].sum()) == 1:
            state = int(ROWS[state].nonzero()[0, 0])
            out.append(state)
        return out

    def consume_token(self, token):
        if not ROWS[self.states[-1], token]:
            return False
        self.states.append(token)
        return True

    def consume_tokens(self, tokens):
        return all(self.consume_token(t) for t in tokens)

    def rollback(self, n):
        del self.states[len(self.states) - n :]
        return True


class AutomatonConstraint(GrammarConstraint):
    def _grammar_mask(self):
        return ROWS[self._matcher.states[-1]].clone()


def constraint():
    return AutomatonConstraint(Automaton(PROMPT[-1]), SimpleNamespace(vocab_size=VOCAB, eos_ids=()))


def exact_budget_joint(table: torch.Tensor, sampling: SamplingParams) -> dict[tuple[int, ...], float]:
    dist = distances()
    rows = processed_probs(table.log().masked_fill(~ROWS, float("-inf")), sampling)
    joint = {}
    for seq in itertools.product(range(VOCAB), repeat=LENGTH):
        prob, last = 1.0, PROMPT[-1]
        for i, t in enumerate(seq):
            left = LENGTH - i
            fits = torch.tensor([bool(ROWS[last, u]) and dist[u] <= left - 1 for u in range(VOCAB)])
            row = rows[last] * fits
            if not fits.any():  # a prefix the budget-masked target never writes
                prob = 0.0
                break
            if row.sum() == 0:  # top-p kept no token that fits: the closing path's (here the first that fits)
                row = torch.zeros(VOCAB)
                row[int(fits.nonzero()[0, 0])] = 1.0
            prob *= float(row[t] / row.sum())
            last = t
        joint[seq] = prob
    return joint


def sample_budgeted(target, make_drafter, sampling, spec, n, seed):
    model = MarkovModel(target)
    counts: dict[tuple[int, ...], int] = {}
    closed = forced = 0
    for i in range(n):
        s = SamplingParams(temperature=sampling.temperature, top_p=sampling.top_p, seed=seed * 100_000 + i,
                           max_tokens=LENGTH)
        seq = new_sequence(PROMPT, s, spec, make_drafter(), ToyCache(), SilentTokenizer(), frozenset(),
                           context_length=64, constraint=constraint())
        result = None
        for event in run_sequence(model, seq):
            result = event.result or result
        closed += result.stats.closing
        forced += result.stats.forced
        key = tuple(result.token_ids)
        counts[key] = counts.get(key, 0) + 1
    return counts, closed, forced


@pytest.fixture(autouse=True)
def small_window(monkeypatch):
    # the chain's closing length is at most 2 and no token raises it by more: a window of 2 keeps
    # the filter exact while rounds before it draft freely (the shipped 24 would window every position)
    monkeypatch.setattr(closing, "WINDOW", 2)


def test_the_reference_distances():
    assert distances() == [0, 1, 2, 1]


CONFIGS = [
    pytest.param(gamma, top_p, drafter, forced, id=f"gamma{gamma}-topp{top_p}-{drafter}-{'forced' if forced else 'unforced'}")
    for gamma, top_p, drafter, forced in [
        (1, 1.0, "sampled", True), (3, 0.8, "sampled", True), (3, 1.0, "onehot", True),
        (3, 1.0, "sampled", False), (3, 1.0, "none", True), (3, 0.8, "none", False),
    ]
]


@pytest.mark.parametrize(("gamma", "top_p", "drafter", "forced"), CONFIGS)
def test_speculative_sampling_with_a_cutting_budget_matches_the_budget_masked_joint(gamma, top_p, drafter, forced):
    target, draft = random_chain(1), random_chain(2)
    sampling = SamplingParams(temperature=0.9, top_p=top_p, max_tokens=LENGTH)
    joint = exact_budget_joint(target, sampling)
    if drafter == "none":
        spec, make = SpecConfig(method="off", forced_drafts=forced), lambda: None
    else:
        spec = SpecConfig(method="draft", gamma=gamma, forced_drafts=forced)
        make = lambda: MarkovDrafter(draft, deterministic=drafter == "onehot")  # noqa: E731
    counts, closed, _ = sample_budgeted(target, make, sampling, spec, N, seed=gamma + 10 * forced)
    assert all(key[-1] in ACCEPTING for key in counts)  # every reply ends valid
    assert closed > N // 4  # the budget cut often
    assert chi_square_p(joint, counts, N) > 1e-3


def test_closing_drawn_without_the_budget_mask_is_caught(monkeypatch):
    # broken: the budget ignored, every position drawn from the grammar's mask alone
    monkeypatch.setattr(closing, "mode", lambda seq, left, rows: (closing.FREE, None, left))
    target, draft = random_chain(1), random_chain(2)
    sampling = SamplingParams(temperature=0.9, max_tokens=LENGTH)
    joint = exact_budget_joint(target, sampling)
    spec = SpecConfig(method="draft", gamma=3)
    counts, _, _ = sample_budgeted(target, lambda: MarkovDrafter(draft, deterministic=False), sampling, spec, N, 31)
    assert chi_square_p(joint, counts, N) < 1e-6


def test_a_window_that_takes_the_closing_token_instead_of_redrawing_is_caught(monkeypatch):
    # broken: a token that does not fit is replaced by the closing path's instead of drawn again
    # (replies still end valid, but the misfit's mass goes to one token instead of all that fit)
    from openalice_runner.engine import generator
    from openalice_runner.engine.sampling import TokenDraws

    real = generator.budget_choice

    def closing_token(logits, seq, allowed, left, path, position, use=TokenDraws.TARGET):
        if use == TokenDraws.CLOSING:
            path = closing.closing_path(seq.constraint, left)
            if path:
                return path[0]
        return real(logits, seq, allowed, left, path, position, use)

    monkeypatch.setattr(generator, "budget_choice", closing_token)
    target, draft = random_chain(1), random_chain(2)
    sampling = SamplingParams(temperature=0.9, max_tokens=LENGTH)
    joint = exact_budget_joint(target, sampling)
    spec = SpecConfig(method="draft", gamma=3)
    counts, _, _ = sample_budgeted(target, lambda: MarkovDrafter(draft, deterministic=False), sampling, spec, N, 32)
    assert all(key[-1] in ACCEPTING for key in counts)
    assert chi_square_p(joint, counts, N) < 1e-6
