"""One sequence's grammar state (`GrammarConstraint`, made by grammar.Grammar.constraint): the
(V,) mask of the tokens allowed next, the tokens it forces, a draft checked along it; and logits and
draft distributions masked by it."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np
import torch

from openalice_runner.engine.grammar_build import _past_limits, _short, llguidance

if TYPE_CHECKING:
    from openalice_runner.engine.grammar import GrammarCompiler


class GrammarConstraint:
    """The grammar state of one sequence: masks, forced tokens, draft checks, advancing."""

    def __init__(self, matcher, compiler: GrammarCompiler):
        """`matcher`: an llguidance LLMatcher (tests pass an automaton with its methods)."""
        self._matcher = matcher
        self._compiler = compiler
        self._bitmask = None
        self.mask_s = 0.0  # time spent computing masks (the benchmark reports it per token)
        self.masks = 0

    @property
    def vocab_size(self) -> int:
        return self._compiler.vocab_size

    def allowed(self) -> torch.Tensor:
        """(V,) bool: the tokens allowed next. A forced token is the only one allowed; EOS is
        allowed where the text so far is complete; never empty (a matcher in error allows EOS)."""
        t0 = time.perf_counter()
        allowed = torch.zeros(self.vocab_size, dtype=torch.bool)
        forced = self._matcher.compute_ff_tokens() if not self._matcher.is_stopped() else []
        if forced:
            allowed[forced[0]] = True
        else:
            allowed = self._grammar_mask()
            eos = list(self._compiler.eos_ids)
            if eos:
                allowed[eos] = bool(allowed[eos].any())  # any of the model's EOS ids, or none
                if not allowed.any():
                    allowed[eos] = True
        self.mask_s += time.perf_counter() - t0
        self.masks += 1
        return allowed

    def _grammar_mask(self) -> torch.Tensor:
        """(V,) bool: the matcher's own mask."""
        if self._bitmask is None:
            self._bitmask = llguidance.numpy.allocate_token_bitmask(1, self.vocab_size)
        llguidance.numpy.fill_next_token_bitmask(self._matcher, self._bitmask, 0)
        bits = np.unpackbits(self._bitmask.view(np.uint8), bitorder="little")[: self.vocab_size]
        return torch.from_numpy(bits.astype(np.bool_))

    def forced(self, limit: int) -> list[int]:
        """Up to `limit` tokens the grammar forces from here (each is then the only allowed one)."""
        if limit <= 0 or self._matcher.is_stopped():
            return []
        return list(self._matcher.compute_ff_tokens()[:limit])

    def walk(self, draft: list[int]) -> tuple[int, torch.Tensor]:
        """Masks along a draft: (n, masks) where draft[:n] is the longest prefix every token of
        which its mask allows, and masks (n + 1, V) are the allowed sets after draft[:i] for
        i = 0..n. The matcher ends where it started."""
        n, masks, _ = self.walk_on(draft, 0)
        return n, masks

    def walk_on(self, draft: list[int], then_forced: int) -> tuple[int, torch.Tensor, list[int]]:
        """`walk`, and where the whole draft is allowed, on through up to `then_forced` tokens
        the grammar forces after it: (n, masks, forced_after), n and masks counting those too."""
        masks = [self.allowed()]
        n = 0
        for token in draft:
            if not bool(masks[-1][token]) or token in self._compiler.eos_ids:
                break
            self._consume(token)
            n += 1
            masks.append(self.allowed())
        after: list[int] = []
        if n == len(draft) and then_forced > 0:
            for token in self.forced(then_forced):
                if token in self._compiler.eos_ids:
                    break
                self._consume(token)
                after.append(token)
                masks.append(self.allowed())
        if n + len(after):
            self._matcher.rollback(n + len(after))
        return n + len(after), torch.stack(masks), after

    def _consume(self, token: int) -> None:
        if not self._matcher.consume_token(token):  # pragma: no cover - the mask allowed it
            _past_limits(self._matcher)
            raise RuntimeError(f"grammar matcher refused a token its mask allowed: {_short(self._matcher.get_error())}")

    def advance(self, tokens: list[int]) -> None:
        """The sequence emitted `tokens` (EOS excluded): the matcher follows."""
        tokens = [t for t in tokens if t not in self._compiler.eos_ids]
        if tokens and not self._matcher.consume_tokens(tokens):  # the masks allowed them: ours
            _past_limits(self._matcher)
            raise RuntimeError(f"grammar matcher refused emitted tokens: {_short(self._matcher.get_error())}")

    @property
    def accepting(self) -> bool:
        """Whether the text so far is complete under the grammar."""
        return self._matcher.is_accepting()


def masked_logits(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Logits (..., V') with the disallowed tokens at -inf (V' may exceed the mask's V: the
    model's padded rows beyond the tokenizer are never allowed)."""
    vocab = allowed.shape[-1]
    out = torch.full_like(logits, float("-inf"))
    keep = allowed.to(logits.device)
    out[..., :vocab] = logits[..., :vocab].masked_fill(~keep, float("-inf"))
    return out


def masked_probs(q: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """A draft distribution (k, V) restricted to the allowed tokens and renormalised (rows
    whose mass is all disallowed stay zero: their draft token was cut before verification)."""
    vocab = allowed.shape[-1]
    out = torch.zeros_like(q)
    out[..., :vocab] = q[..., :vocab] * allowed.to(q.dtype)
    total = out.sum(dim=-1, keepdim=True)
    return torch.where(total > 0, out / total.clamp_min(1e-30), out)
