"""Turn logits into the distribution that sampling draws from.

The same transformation (temperature, then top-k, then top-p) is applied to the target's and
the drafter's logits, so that rejection sampling compares like with like and the output is
exactly a sample of the processed target distribution.
"""

from __future__ import annotations

import hashlib
import secrets

import torch

from openalice_runner.engine.types import SamplingParams


def processed_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities (..., V) in fp32 after temperature, top-k and top-p. Requires temperature > 0."""
    if params.greedy:
        raise ValueError("processed_probs is for sampling; greedy decoding takes the argmax")
    scores = logits.float() / params.temperature
    vocab = scores.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(scores, params.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if params.top_p < 1.0:
        probs = _top_p_filter(probs, params.top_p)
    return probs


def _top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    # Keep the smallest set of most likely tokens whose mass reaches top_p (the token that
    # crosses the threshold is kept), then renormalise.
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    sorted_probs = sorted_probs.masked_fill(mass_before >= top_p, 0.0)
    kept = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    return kept / kept.sum(dim=-1, keepdim=True)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token id from a 1-D distribution."""
    return int(torch.multinomial(probs, 1, generator=generator).item())


class TokenDraws:
    """Where a sequence's randomness comes from: one stream per (token position, use), derived
    from the request's seed (a fresh random one without a seed).

    Keying the streams by position, not drawing them in turn from one generator, keeps what a
    token draws independent of how the rounds before it went: how long their drafts were (the
    drafters size them by measured pass costs and the batch's load) and how many draws their
    verification took. The same seed therefore gives the same tokens alone or in a batch."""

    TARGET = 0  # the target's own sample for a position (plain, bonus or recovered token)
    ACCEPT = 1  # the uniform that accepts or rejects a sampled draft token
    DRAFT = 2  # a drafter's draws for the round whose first token lands at this position
    CLOSING = 3  # a token drawn again because the one drawn leaves no room to close (engine/closing.py)

    def __init__(self, seed: int | None):
        self.seed = secrets.randbits(63) if seed is None else seed

    def stream(self, position: int, use: int) -> torch.Generator:
        digest = hashlib.blake2b(f"{self.seed}:{position}:{use}".encode(), digest_size=8).digest()
        generator = torch.Generator()
        generator.manual_seed(int.from_bytes(digest, "little"))
        return generator


Draws = TokenDraws | torch.Generator | None


def stream(draws: Draws, position: int, use: int) -> torch.Generator | None:
    """The generator for one draw: a TokenDraws' stream for (position, use); a plain generator
    (or None, torch's global one) serves every draw in turn, as tests of one verification use."""
    return draws.stream(position, use) if isinstance(draws, TokenDraws) else draws
