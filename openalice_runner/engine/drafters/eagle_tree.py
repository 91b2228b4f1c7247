"""Growing a draft tree with an EAGLE head, and choosing which of its nodes to verify.

As in EAGLE-2: each candidate's score is the head's probability of its path (the product of
its own and its ancestors' probabilities), which estimates the chance that the target accepts
the whole path. Depth 1 holds the head's top `width` tokens after the root. Each further depth
expands the `beam` best-scored nodes of the last depth with one head step over all of them
(each row sees its own ancestors: a tree mask on the head's cache) and adds each one's top
`width` children. Growth stops at the depth cap, where no candidate is likely enough to
matter, or, with pass costs, where even the best next node (guessed as sure as its parent
was) would not make the tree worth more than the one already grown: a head step is not free.

The nodes verified are the best-scored ones: a child never scores above its parent, so they
form a tree. The expected number of accepted tokens is the sum of their scores; with the
engine's pass costs, the drafter verifies the number of nodes that gives the most tokens per
unit of pass and head-step time, and none where no tree beats decoding alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from openalice_runner.engine.tree import MAX_NODES, TreeMask

WIDTH = 4  # children per expanded node (the head's top-k)
BEAM = 3  # nodes expanded per depth
MIN_SCORE = 0.05  # a node this unlikely is not worth a verify row or an expansion


@dataclass
class Candidate:
    token: int
    parent: int  # index in the candidate list, -1 for the root's children
    depth: int
    score: float  # the head's probability of the whole path to this node
    head_row: int = -1  # the head-cache row that expanded it (-1: not expanded)


def top_children(logits: torch.Tensor, vocab: torch.Tensor, width: int) -> list[tuple[int, float]]:
    """The head's `width` most likely tokens (full ids) after a feature row, with probabilities."""
    probs = torch.softmax(logits.float(), dim=-1)
    p, idx = probs.topk(min(width, probs.shape[-1]))
    return [(int(vocab[i]), float(q)) for i, q in zip(idx.tolist(), p.tolist(), strict=True)]


def grow(runtime, cache, root_feat: torch.Tensor, last: int, max_depth: int, max_rows: int,
         width: int = WIDTH, beam: int = BEAM, max_nodes: int = MAX_NODES, value=None) -> tuple[list[Candidate], int]:
    """Candidates after the root, whose predicted feature is `root_feat` (1, H) and whose
    position is last + 1; returns them (every parent before its children) and the number of
    head steps taken. The head's rows go to cache places last + 1 .. last + max_rows. `value`:
    as for `select`, to stop growing where another depth cannot pay."""
    nodes = [Candidate(t, -1, 1, p) for t, p in top_children(runtime.logits(root_feat)[0], runtime.vocab, width)]
    feats = {-1: root_feat[0]}  # candidate -> its predicted feature (its expansion's output)
    bits: dict[int, int] = {-1: 0}  # candidate -> head-cache rows it sees past `last`
    frontier = list(range(len(nodes)))
    rows_used = steps = 0
    for depth in range(2, max_depth + 1):
        expand = sorted((i for i in frontier if nodes[i].score >= MIN_SCORE), key=lambda i: -nodes[i].score)
        expand = expand[: min(beam, max_rows - rows_used)]
        if not expand or (value is not None and not _worth_growing(nodes, expand[0], max_nodes, value)):
            break
        mask_rows = []
        for i in expand:
            nodes[i].head_row = rows_used
            bits[i] = bits[nodes[i].parent] | (1 << rows_used)
            # the row reads the parent's feature and this node's token, at the node's place in text
            mask_rows.append((last + 1, bits[i], last + nodes[i].depth))
            rows_used += 1
        inputs = torch.stack([feats[nodes[i].parent] for i in expand])
        out = runtime.step(cache, inputs, [nodes[i].token for i in expand],
                           [last + 1 + nodes[i].head_row for i in expand], TreeMask.from_rows(mask_rows))
        steps += 1
        logits = runtime.logits(out)
        frontier = []
        for row, i in enumerate(expand):
            feats[i] = out[row]
            for token, p in top_children(logits[row], runtime.vocab, width):
                frontier.append(len(nodes))
                nodes.append(Candidate(token, i, depth, nodes[i].score * p))
        if len(nodes) >= 4 * MAX_NODES:
            break
    return nodes, steps


def _ranked(nodes: list[Candidate], max_nodes: int) -> list[int]:
    """The best-scored nodes, best first; a parent ranks before its children (ties by creation)."""
    return sorted(range(len(nodes)), key=lambda i: (-nodes[i].score, i))[: min(max_nodes, MAX_NODES)]


def _best(nodes: list[Candidate], max_nodes: int, value) -> tuple[int, float, float, int]:
    """(n, its value, expected tokens, depth) of the best number of top-scored nodes to verify."""
    order = _ranked(nodes, max_nodes)
    best = (0, 1.0, 0.0, 0)
    expected, depth = 0.0, 0
    for k, i in enumerate(order, start=1):
        expected += nodes[i].score
        depth = max(depth, nodes[i].depth)
        v = value(k, expected, depth)
        if v > best[1]:
            best = (k, v, expected, depth)
    return best


def _worth_growing(nodes: list[Candidate], frontier_best: int, max_nodes: int, value) -> bool:
    """Whether the best child of the best frontier node, guessed as sure as that node was of
    its parent, would raise the value of the best tree grown so far."""
    n, best_value, expected, depth = _best(nodes, max_nodes, value)
    node = nodes[frontier_best]
    parent_score = 1.0 if node.parent < 0 else nodes[node.parent].score
    guess = node.score * node.score / max(parent_score, 1e-9)
    if n >= max_nodes:
        return False
    return value(n + 1, expected + guess, max(depth, node.depth + 1)) > best_value


def select(nodes: list[Candidate], max_nodes: int, value=None) -> tuple[list[int], list[int]]:
    """The best-scored nodes as a tree: (tokens, parents) in topological order. `value(n,
    expected, depth)` -> tokens per unit cost of verifying the best n (None: take max_nodes)."""
    order = _ranked(nodes, max_nodes)
    n = len(order) if value is None else _best(nodes, max_nodes, value)[0]
    chosen = sorted(order[:n])  # creation order: parents first
    index = {i: j for j, i in enumerate(chosen)}
    tokens = [nodes[i].token for i in chosen]
    parents = [-1 if nodes[i].parent < 0 else index[nodes[i].parent] for i in chosen]
    return tokens, parents
