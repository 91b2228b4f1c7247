"""Budget-aware closing: a grammar-constrained reply ends valid within its token budget.

Under a grammar the engine knows, at every position, a way to finish the structure (close the
open string, the object, the call) and how many tokens it takes; `closing_path` finds one by a
greedy search over the matcher (forced tokens first, else the allowed candidates in a fixed
order: `"`, `}`, `]`, `,`, `0`, ... as single-byte tokens). It is an upper bound on the shortest
completion in tokens (a greedy byte path, not the best tokenization), which is all validity
needs: whatever it finds, the matcher accepted.

The budget-and-grammar-masked target at a position with `left` tokens still allowed (max_tokens
or the context's end) and closing length `c`:

- `left <= c` (**closing**): only the closing path's next token. Those tokens are certain, so a
  round drafts them for free (forced tokens) and verifies them in one pass.
- `left - c <= WINDOW` (**window**): the grammar's tokens `t` after which the closing still fits,
  `c(after t) <= left - 1`. Checked lazily on the tokens a round emits: rounds draft and verify
  as ever, and the first emitted token that does not fit is chosen again among those that fit
  (greedy: the next best; sampled: drawn again without it, which is exactly the target restricted
  to the tokens that fit), so a search or two runs per emitted token, only there.
- otherwise (**free**): the grammar's mask alone. A round stops at the window's edge.

The filter removes nothing while `left - 1` is above every reachable token's closing length, so
skipping it outside the window changes nothing as long as no token raises the closing length by
more than WINDOW within a round (JSON raises it by a key and a value at most; a deeper jump is
where a reply can still be cut). Far from the end nothing is computed: the closing length is
refreshed only when the slack left since its last figure shrinks by a quarter, so a reply that
ends well within its budget costs a search or two (docs/grammar.md has the figures).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from openalice_runner.engine.grammar_constraint import GrammarConstraint

WINDOW = 24  # tokens of slack, above the closing length, from which the filter applies
SEARCH_NODES = 256  # tokens one closing search may try (consumed, backtracked included)

# the closing search's order among tokens the grammar allows (single characters): what ends a
# string first (a string that must grow takes letters, never allowed outside one), then what ends
# an object or array, a separator, the shortest values, then anything
CLOSING_ORDER = '"a}],0' + "\n" + "[{nft-1" + " bcdeghijklmopqrsuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ23456789.:_"


def closing_candidates(tokenizer, vocab_size: int) -> list[int]:
    """Token ids of CLOSING_ORDER's characters, each where it is one token of its own."""
    out: list[int] = []
    for ch in CLOSING_ORDER:
        try:
            ids = tokenizer.encode(ch, add_special_tokens=False)
        except Exception:  # pragma: no cover - a tokenizer that cannot encode one character
            continue
        if len(ids) == 1 and 0 <= ids[0] < vocab_size and ids[0] not in out:
            out.append(ids[0])
    return out


def closing_path(constraint, limit: int, first: int | None = None) -> list[int] | None:
    """Tokens from the constraint's state (after `first`, where given) to one the grammar accepts,
    at most `limit` of them (None: none found within it); the matcher ends where it started.

    Greedy depth-first: the grammar's forced tokens where it forces some, else the candidates it
    allows in their order, backing up from a dead end, within SEARCH_NODES tokens tried. The time
    counts as the constraint's mask time (the benchmark's grammar cost)."""
    t0 = time.perf_counter()
    matcher = constraint._matcher
    try:
        if first is None:
            return _search(constraint, limit)
        if not matcher.consume_token(first):
            return None
        try:
            return _search(constraint, limit)
        finally:
            matcher.rollback(1)
    finally:
        constraint.mask_s += time.perf_counter() - t0


def _options(constraint) -> list[int]:
    """The tokens the search may take next, in its order."""
    matcher = constraint._matcher
    eos = constraint._compiler.eos_ids
    forced = [t for t in matcher.compute_ff_tokens() if t not in eos]
    if forced:
        return forced[:1]
    mask = constraint._grammar_mask()
    candidates = getattr(constraint._compiler, "closing_candidates", None)
    if candidates is None:  # a small test vocabulary: every token, in id order
        candidates = range(constraint.vocab_size)
    return [t for t in candidates if bool(mask[t]) and t not in eos]


def _search(constraint, limit: int) -> list[int] | None:
    matcher = constraint._matcher
    path: list[int] = []
    stack: list[list[int]] = []  # per level taken, its alternatives not tried yet
    tried = 0
    found = True
    while not (matcher.is_accepting() or matcher.is_stopped()):
        alternatives = _options(constraint) if len(path) < limit and tried < SEARCH_NODES else []
        while True:
            while alternatives:
                token = alternatives.pop(0)
                tried += 1
                if matcher.consume_token(token):
                    path.append(token)
                    stack.append(alternatives)
                    break
            else:
                if not stack or tried >= SEARCH_NODES:
                    found = False
                    break
                alternatives = stack.pop()  # back up one level and try its next alternative
                matcher.rollback(1)
                path.pop()
                continue
            break
        if not found:
            break
    if path:
        matcher.rollback(len(path))
    return path if found else None


FREE, WINDOWED, CLOSING = "free", "window", "closing"


@dataclass
class Budget:
    """One sequence's closing state, across its rounds: the grammar it closes, the tokens that end
    it, the last closing path, where it was found, and when to look again (positions are
    len(seq.tokens)). A round reads it (`mode`) and the window checks tokens against it (`fits`)."""

    constraint: GrammarConstraint | None = None
    eos_ids: frozenset[int] = frozenset()
    path: list[int] | None = None
    at: int = -1
    refresh_at: int = 0
    # paths found after a token the window checked: (position, token) -> path
    checked: dict[tuple[int, int], list[int] | None] = field(default_factory=dict)
    closing: int = 0  # tokens the reply was forced to close with

    def known(self, tokens: list[int]) -> list[int] | None:
        """The closing path from len(tokens), where the last one found still applies: the reply
        since followed it (as far as it did), then took a token the window checked."""
        position = len(tokens)
        if self.path is None or self.at < 0 or self.at > position:
            return None
        k = 0
        while k < len(self.path) and self.at + k < position and tokens[self.at + k] == self.path[k]:
            k += 1
        at = self.at + k
        if at == position:
            if k:
                self._set(self.path[k:], position)
            return self.path
        if at == position - 1 and (at, tokens[-1]) in self.checked:
            hit = self.checked[(at, tokens[-1])]
            if hit is not None:
                self._set(hit, position)
            return hit
        return None

    def _set(self, path: list[int], position: int) -> None:
        self.path, self.at = path, position
        self.checked.clear()


def mode(budget: Budget, tokens: list[int], left: int, round_rows: int) -> tuple[str, list[int] | None, int]:
    """(mode, closing path, tokens this round may emit) for a constrained reply of `tokens` with
    `left` tokens still allowed (see the module's rules)."""
    position = len(tokens)
    path = budget.known(tokens)
    if path is None:
        last = len(budget.path) if budget.path is not None else 0
        if left - last > WINDOW + round_rows + 1 and position < budget.refresh_at:
            return FREE, None, left
        path = closing_path(budget.constraint, limit=left + WINDOW + round_rows + 1)
        if path is None:  # none within reach: nothing to close towards (the grammar may loop)
            budget.path, budget.at = None, -1
            budget.refresh_at = position + max(1, left // 4)
            return FREE, None, left
        budget._set(path, position)
    c = len(path)
    slack = left - c
    budget.refresh_at = position + max(1, (slack - WINDOW - round_rows) // 4)
    if slack <= 0:
        return CLOSING, path, left
    if slack <= WINDOW:
        return WINDOWED, path, left
    return FREE, path, slack - WINDOW


def fits(budget: Budget, position: int, token: int, left: int) -> bool:
    """Whether the closing still fits `left - 1` tokens after `token` at `position` (the matcher's
    state; EOS: the reply ends)."""
    if token in budget.eos_ids:
        return True
    key = (position, token)
    if key not in budget.checked:
        budget.checked[key] = closing_path(budget.constraint, limit=left - 1, first=token)
    return budget.checked[key] is not None


MAX_REDRAWS = 32  # window tokens tried before the closing path's own is taken


def windowed_choice(budget: Budget, position: int, allowed: torch.Tensor, left: int, path: list[int] | None,
                    choose, redraw) -> int:
    """The target's token among `allowed` after which the closing fits: `choose(allowed)` picks
    one; a token that does not fit is left out and `redraw` picks again (greedy: the next best;
    sampled: a fresh draw from what is left, which is exactly the target restricted to the tokens
    that fit). After MAX_REDRAWS misses, the closing path's token (it always fits)."""
    given, allowed = allowed, allowed.clone()
    token = choose(allowed)
    for _ in range(MAX_REDRAWS):
        if token is None:
            break
        if fits(budget, position, token, left):
            return token
        allowed[token] = False
        if not bool(allowed.any()):
            break
        token = redraw(allowed, token)
    if path is None:
        path = closing_path(budget.constraint, limit=left)
    return path[0] if path else int(given.nonzero()[0, 0])  # none fits (no end token): the reply is cut


@contextmanager
def ahead(constraint, tokens: list[int]):
    """The constraint's matcher moved on through `tokens` (all allowed) for the block's duration."""
    if tokens and not constraint._matcher.consume_tokens(tokens):  # pragma: no cover - the masks allowed them
        raise RuntimeError("grammar matcher refused tokens its masks allowed")
    try:
        yield
    finally:
        if tokens:
            constraint._matcher.rollback(len(tokens))


def shortest_reply(grammar, room: int) -> int | None:
    """Tokens the closing search needs from the grammar's start: the fewest a reply takes here (an
    upper bound); None where it finds no end within a search (then nothing is refused)."""
    path = closing_path(grammar.constraint(), limit=max(room, 0) + SEARCH_NODES)
    return None if path is None else len(path)


def onehot_rows(tokens: list[int], vocab: int) -> torch.Tensor:
    rows = torch.zeros(len(tokens), vocab, dtype=torch.bool)
    rows[torch.arange(len(tokens)), torch.tensor(tokens, dtype=torch.long)] = True
    return rows
