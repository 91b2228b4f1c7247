"""Turn logits into the distribution that sampling draws from.

The same transformation (temperature, then top-k, then top-p) is applied to the target's and
the drafter's logits, so that rejection sampling compares like with like and the output is
exactly a sample of the processed target distribution.
"""

from __future__ import annotations

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


def make_generator(seed: int | None) -> torch.Generator:
    gen = torch.Generator()
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen
