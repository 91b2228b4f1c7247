"""Verification of draft tokens against the target: the rule that makes speculation lossless.

Vocabulary (as in vLLM's rejection sampler):
- accepted tokens: the prefix of the draft the target agrees with;
- recovered token: at the first rejection, one token drawn from the residual
  norm(max(0, p - q)), after which the round stops;
- bonus token: when every draft token is accepted, one token drawn from the target's
  distribution after the last draft.
Each round therefore emits `accepted + 1` tokens.

Drafts chosen deterministically (n-gram lookup, greedy draft models) have a one-hot q:
accept x with probability p(x); the residual is p with x zeroed, renormalised.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from openalice_runner.engine.sampling import Draws, TokenDraws, sample, stream


@dataclass(frozen=True)
class Verdict:
    accepted: int  # number of draft tokens accepted
    next_token: int  # the recovered token (after a rejection) or the bonus token

    def emitted(self, draft: list[int]) -> list[int]:
        return draft[: self.accepted] + [self.next_token]


def verify_greedy(target_argmax: list[int], draft: list[int]) -> Verdict:
    """Greedy verification: `target_argmax[i]` is the target's choice after draft[:i]."""
    accepted = 0
    for proposed, chosen in zip(draft, target_argmax, strict=False):
        if proposed != chosen:
            break
        accepted += 1
    return Verdict(accepted, target_argmax[accepted])


def residual_distribution(p: torch.Tensor, q: torch.Tensor | None, token: int) -> torch.Tensor:
    """norm(max(0, p - q)); q=None means one-hot q at `token`."""
    if q is None:
        residual = p.clone()
        residual[token] = 0.0
    else:
        residual = torch.clamp(p - q, min=0.0)
    total = residual.sum()
    if total <= 0.0:
        # p <= q everywhere means p == q (both sum to 1): rejection had probability 0 and
        # cannot happen except through rounding; p itself is the right fallback.
        return p
    return residual / total


def verify_sampled(
    p: torch.Tensor,
    q: torch.Tensor | None,
    draft: list[int],
    draws: Draws,
    position: int = 0,
) -> Verdict:
    """Exact rejection sampling.

    p: (k+1, V) processed target probabilities; row i is the target's distribution for the
       token after draft[:i].
    q: (k, V) processed draft probabilities, or None when the draft is deterministic (one-hot).
    draws: where the randomness comes from (sampling.TokenDraws: row i draws from the streams of
       `position + i`, the position its token lands at).

    A one-hot draft is verified by the target's own sample for each row, accepted while it is
    the drafted token: x is accepted with probability p(x), and a rejected row emits a sample
    of p without x, the residual; the same rule as drawing u < p(x), but the emitted tokens are
    then the ones plain decoding draws from the same streams, whatever was drafted.
    """
    k = len(draft)
    if q is None:
        for i in range(k + 1):
            token = sample(p[i], stream(draws, position + i, TokenDraws.TARGET))
            if i == k or token != draft[i]:
                return Verdict(i, token)
    for i, x in enumerate(draft):
        u = float(torch.rand((), generator=stream(draws, position + i, TokenDraws.ACCEPT)))
        # accept iff u * q(x) < p(x): the same as u < p/q without dividing, so q(x) = 0
        # (the draft proposed a token it gave no mass) accepts only where p(x) > 0.
        if not u * float(q[i, x]) < float(p[i, x]):
            residual = residual_distribution(p[i], q[i], x)
            return Verdict(i, sample(residual, stream(draws, position + i, TokenDraws.TARGET)))
    return Verdict(k, sample(p[k], stream(draws, position + k, TokenDraws.TARGET)))
