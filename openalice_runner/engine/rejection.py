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
    generator: torch.Generator | None,
) -> Verdict:
    """Exact rejection sampling.

    p: (k+1, V) processed target probabilities; row i is the target's distribution for the
       token after draft[:i].
    q: (k, V) processed draft probabilities, or None when the draft is deterministic (one-hot).
    """
    k = len(draft)
    if k:
        index = torch.tensor(draft).unsqueeze(1)
        p_draft = p[:k].gather(1, index).squeeze(1)
        q_draft = torch.ones(k) if q is None else q.gather(1, index).squeeze(1)
        uniforms = torch.rand(k, generator=generator)
        # accept iff u * q(x) < p(x): the same as u < p/q without dividing, so q(x) = 0
        # (the draft proposed a token it gave no mass) accepts only where p(x) > 0.
        accept = (uniforms * q_draft) < p_draft
        rejected = (~accept).nonzero()
        if rejected.numel():
            i = int(rejected[0, 0])
            residual = residual_distribution(p[i], None if q is None else q[i], draft[i])
            return Verdict(i, int(torch.multinomial(residual, 1, generator=generator).item()))
    bonus = int(torch.multinomial(p[k], 1, generator=generator).item())
    return Verdict(k, bonus)
