"""One position's token from the target's logits: greedy or drawn, within the grammar's mask, and
near the budget's end among the tokens after which the reply can still close (closing.py)."""

from __future__ import annotations

import torch

from openalice_runner.engine import closing
from openalice_runner.engine.cpu_kernels import cpu_kernels
from openalice_runner.engine.grammar_constraint import masked_logits
from openalice_runner.engine.sampling import TokenDraws, processed_probs, sample, stream
from openalice_runner.engine.sequence import Sequence, tokens_left


def choose_token(logits: torch.Tensor, seq: Sequence) -> int:
    allowed = None if seq.constraint is None else seq.constraint.allowed()
    if allowed is not None:
        left = tokens_left(seq)
        state, path, _ = closing.mode(seq.budget, seq.tokens, left, 0)
        if state == closing.CLOSING:
            seq.budget.closing += 1
            return path[0]
        if state == closing.WINDOWED:
            return budget_choice(logits, seq, allowed, left, path, len(seq.tokens))
    if seq.sampling.greedy:
        return greedy_choices(logits.unsqueeze(0), None if allowed is None else allowed.unsqueeze(0))[0]
    if allowed is not None:
        logits = masked_logits(logits, allowed)
    # the token lands at position len(seq.tokens): it draws from that position's stream
    return sample(processed_probs(logits, seq.sampling), stream(seq.draws, len(seq.tokens), TokenDraws.TARGET))


def budget_choice(logits: torch.Tensor, seq: Sequence, allowed: torch.Tensor, left: int, path: list[int] | None,
                  position: int, use: int = TokenDraws.TARGET) -> int:
    """A window position's token (closing.windowed_choice): the target's greedy choice or draw among
    the grammar's tokens after which the closing still fits; `position`: where it lands, `use`: the
    draws' stream (a redraw after the round's own draw takes a stream of its own)."""
    if seq.sampling.greedy:
        pick = lambda mask: greedy_choices(logits.unsqueeze(0), mask.unsqueeze(0))[0]  # noqa: E731
        return closing.windowed_choice(seq.budget, position, allowed, left, path, pick, lambda mask, _: pick(mask))
    probs = processed_probs(masked_logits(logits, allowed), seq.sampling)
    generator = stream(seq.draws, position, use)

    def draw(mask: torch.Tensor, _=None) -> int | None:
        kept = torch.zeros_like(probs)
        kept[: mask.shape[-1]] = probs[: mask.shape[-1]] * mask.to(probs.dtype)
        total = float(kept.sum())
        return None if total <= 0 else sample(kept / total, generator)

    return closing.windowed_choice(seq.budget, position, allowed, left, path, draw, draw)


def greedy_choices(logits: torch.Tensor, allowed: torch.Tensor | None = None) -> list[int]:
    """Each row's argmax of logits (R, V'), within `allowed` (R, V) where given: the engine's
    kernel where it builds (torch's masked copy and argmax cost about 5 ms on a 12-row verify
    over a 49k vocabulary), else torch. Ties go to the first index either way."""
    kernels = cpu_kernels()
    if kernels is not None:
        return kernels.argmax(logits, allowed)
    if allowed is not None:
        logits = masked_logits(logits, allowed)
    return logits.argmax(dim=-1).tolist()
