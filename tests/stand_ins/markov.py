"""A random Markov chain as a target model, its exact joint over short sequences, and the chi-square
check: the harness of the sampling-exactness tests (serial and batched)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from scipy.stats import chisquare

from openalice_runner.engine.drafters.base import Drafter, Proposal
from openalice_runner.engine.generator import new_sequence, run_sequence
from openalice_runner.engine.sampling import processed_probs
from openalice_runner.engine.types import SamplingParams, SpecConfig

VOCAB = 4
LENGTH = 3
PROMPT = [0]


@dataclass
class ToyCache:
    max_len: int = 64

    def __post_init__(self):
        self.lengths = [0]

    def keep(self, slot, sources, start):  # a draft tree's path: the toy model keeps no keys
        pass


class MarkovModel:
    """`forward` returns the tokens as the "hidden state"; `logits` looks up the next-token row."""

    def __init__(self, table: torch.Tensor):
        self.log_table = table.log()

    def forward(self, tokens: torch.Tensor, cache: ToyCache, slots: list[int]) -> torch.Tensor:
        cache.lengths[slots[0]] += tokens.shape[1]
        return tokens

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.log_table[hidden]


class SilentTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return ""


class MarkovDrafter(Drafter):
    """Samples drafts from its own chain q (a stand-in for a draft model)."""

    def __init__(self, table: torch.Tensor, deterministic: bool):
        self.log_table = table.log()
        self.deterministic = deterministic

    def propose(self, history, gamma, sampling, generator):
        tokens, rows, last = [], [], history[-1]
        for _ in range(gamma):
            probs = processed_probs(self.log_table[last], sampling)
            if self.deterministic:
                last = int(probs.argmax())
            else:
                last = int(torch.multinomial(probs, 1, generator=generator))
                rows.append(probs)
            tokens.append(last)
        return Proposal(tokens, None if self.deterministic else torch.stack(rows))


def random_chain(seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    table = torch.rand(VOCAB, VOCAB, generator=gen) ** 2 + 0.02
    return table / table.sum(-1, keepdim=True)


def exact_joint(table: torch.Tensor, sampling: SamplingParams,
                allowed: torch.Tensor | None = None, length: int = LENGTH) -> dict[tuple[int, ...], float]:
    """The exact probability of every reply of `length` tokens; `allowed` (rows of a grammar's
    mask) masks and renormalises each row first, as the constrained decoder does."""
    logits = table.log() if allowed is None else table.log().masked_fill(~allowed, float("-inf"))
    rows = processed_probs(logits, sampling)
    joint = {}
    for seq in itertools.product(range(VOCAB), repeat=length):
        prob, last = 1.0, PROMPT[-1]
        for t in seq:
            prob *= float(rows[last, t])
            last = t
        joint[seq] = prob
    return joint


def sample_sequences(target, drafter, sampling, gamma, n, seed) -> dict[tuple[int, ...], int]:
    model = MarkovModel(target)
    counts: dict[tuple[int, ...], int] = {}
    for i in range(n):
        s = SamplingParams(temperature=sampling.temperature, top_p=sampling.top_p, seed=seed * 100_000 + i,
                           max_tokens=LENGTH)
        seq = new_sequence(PROMPT, s, SpecConfig(method="draft", gamma=gamma), drafter, ToyCache(),
                           SilentTokenizer(), frozenset(), context_length=64)
        result = None
        for event in run_sequence(model, seq):
            result = event.result or result
        key = tuple(result.token_ids)
        counts[key] = counts.get(key, 0) + 1
    return counts


def chi_square_p(joint, counts, n) -> float:
    keys = [k for k, p in joint.items() if p > 0]
    impossible = sum(c for k, c in counts.items() if joint.get(k, 0.0) == 0.0)
    if impossible:
        return 0.0  # a sequence the target cannot produce
    observed = [counts.get(k, 0) for k in keys]
    expected = [joint[k] * n for k in keys]
    scale = sum(observed) / sum(expected)
    return float(chisquare(observed, [e * scale for e in expected]).pvalue)
