"""Speculative trees: several candidate continuations verified in one target pass.

A tree proposal is a list of draft tokens in topological order (every node after its parent)
with `parents[i]`, the index of node i's parent, or -1 for a child of the root. The root is the
emitted but not yet fed last token; a chain is the tree whose parents are -1, 0, 1, ...

In the pass, the root sits at cache position `start` and node i at `start + 1 + i`; node i's
rotary position is `start` + its depth, and it sees the prefix up to the root and then only
its ancestors and itself (`TreeMask`). After verification the accepted path's keys and values
move down to `start + 1 ..` (`KVCache.keep`), where a chain would have written them.

Verification walks from the root. Greedy: follow the child whose token is the target's argmax;
emit the argmax where no child has it. Sampling, with deterministic drafts (one-hot q, as the
head's top-k children are): try the children in order, accepting child c with probability
p(c) under the current residual p, which after each rejection is p with c zeroed and
renormalised; where every child is rejected, draw from that residual. Each emitted token so
follows the target's distribution exactly (SpecInfer's multi-candidate rule for one-hot drafts).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from openalice_runner.engine.sampling import Draws, TokenDraws, sample, stream

MAX_NODES = 63  # a row's visible tree nodes are bits of one int64


@dataclass(frozen=True)
class TreeMask:
    """Which cache keys each row of a pass sees, and each row's rotary position.

    Row r sees keys 0..visible_from[r]-1 of its slot, then only the keys visible_from[r] + b for
    the set bits b of bits[r], in increasing order. A row whose visible_from is above its own
    position is a plain row and sees every key up to its own."""

    visible_from: torch.Tensor  # (R,) int64
    bits: torch.Tensor  # (R,) int64
    rope_pos: torch.Tensor  # (R,) int64

    @classmethod
    def from_rows(cls, rows: list[tuple[int, int, int]]) -> TreeMask:
        """From (visible_from, bits, rope position) per row."""
        t = torch.tensor(rows, dtype=torch.long).view(-1, 3)
        return cls(t[:, 0].contiguous(), t[:, 1].contiguous(), t[:, 2].contiguous())

    def visible(self, r: int, pos: int) -> list[int]:
        """The keys row r (at cache position `pos`) sees, in order (reference and fallback path)."""
        start = int(self.visible_from[r])
        if start > pos:
            return list(range(pos + 1))
        bits = int(self.bits[r])
        return list(range(start)) + [start + b for b in range(MAX_NODES) if (bits >> b) & 1]


def depths(parents: list[int]) -> list[int]:
    """Depth of each node (children of the root have depth 1)."""
    out: list[int] = []
    for parent in parents:
        out.append(1 if parent < 0 else out[parent] + 1)
    return out


def check_parents(parents: list[int]) -> None:
    if len(parents) > MAX_NODES:
        raise ValueError(f"a draft tree has at most {MAX_NODES} nodes, got {len(parents)}")
    for i, parent in enumerate(parents):
        if not -1 <= parent < i:
            raise ValueError(f"draft tree node {i} has parent {parent}: parents must come first")


def plain_rows(start: int, count: int) -> list[tuple[int, int, int]]:
    """Mask rows for `count` consecutive plain rows from position `start`."""
    return [(start + t + 1, 0, start + t) for t in range(count)]


def tree_rows(start: int, parents: list[int]) -> list[tuple[int, int, int]]:
    """Mask rows of one sequence's round: the root at `start`, then node i at `start + 1 + i`."""
    rows = [(start + 1, 0, start)]
    bits: list[int] = []
    for i, (parent, depth) in enumerate(zip(parents, depths(parents), strict=True)):
        bits.append((0 if parent < 0 else bits[parent]) | (1 << i))
        rows.append((start + 1, bits[i], start + depth))
    return rows


def children(parents: list[int]) -> list[list[int]]:
    """children[0] are the root's children; children[1 + i] node i's, in proposal order."""
    out: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for i, parent in enumerate(parents):
        out[parent + 1].append(i)
    return out


@dataclass(frozen=True)
class TreeVerdict:
    path: list[int]  # the accepted nodes, root's child first
    next_token: int  # recovered (after a rejection) or bonus token

    @property
    def accepted(self) -> int:
        return len(self.path)

    def emitted(self, tokens: list[int]) -> list[int]:
        return [tokens[i] for i in self.path] + [self.next_token]


def verify_tree_greedy(target_argmax: list[int], tokens: list[int], parents: list[int]) -> TreeVerdict:
    """`target_argmax[0]` is the target's choice after the root, `target_argmax[1 + i]` after node i."""
    kids = children(parents)
    path: list[int] = []
    row = 0
    while True:
        chosen = target_argmax[row]
        nxt = next((c for c in kids[row] if tokens[c] == chosen), None)
        if nxt is None:
            return TreeVerdict(path, chosen)
        path.append(nxt)
        row = nxt + 1


def verify_tree_sampled(p: torch.Tensor, tokens: list[int], parents: list[int], draws: Draws,
                        position: int = 0) -> TreeVerdict:
    """Exact multi-candidate rejection sampling for one-hot drafts. p: (N+1, V) processed target
    probabilities, row 0 after the root and row 1 + i after node i; the token at depth d draws
    from the streams of `position + d` (see sampling.TokenDraws).

    At each node the target draws its own sample and the path follows the child that drafted
    it: child x is taken with probability p(x), and where no child matches, the sample is a draw
    of p without the children's tokens, the residual of trying them in turn (verify_sampled's
    rule for one draft, for several)."""
    kids = children(parents)
    path: list[int] = []
    row = 0
    while True:
        token = sample(p[row], stream(draws, position + len(path), TokenDraws.TARGET))
        nxt = next((c for c in kids[row] if tokens[c] == token), None)
        if nxt is None:
            return TreeVerdict(path, token)
        path.append(nxt)
        row = nxt + 1
