"""Draft trees: tree attention in one pass, the accepted path's cache, and tree verification.

The exactness of sampled tree drafting through the decode loop is tested in
test_engine_sampling_exact.py; greedy equality with `off` in test_engine_eagle.py.
"""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from openalice_runner.engine.llama import LlamaModel
from openalice_runner.engine.tree import (
    TreeMask,
    check_parents,
    depths,
    plain_rows,
    tree_rows,
    verify_tree_greedy,
    verify_tree_sampled,
)

PROMPT = [5, 17, 3, 99, 42, 7, 7, 12]
# root -> x (0), a (1); a -> y (2), b (3); b -> c (4); x -> z (5)
X, A, Y, B, C, Z = 301, 302, 303, 304, 305, 306
TOKENS = [X, A, Y, B, C, Z]
PARENTS = [-1, -1, 1, 1, 3, 0]
PATH = [1, 3, 4]  # a, b, c: the chain the tree must reproduce


def _models(tiny_engine):
    """The kernel-backed forward and torch's (SDPA) forward over the same weights."""
    fast = tiny_engine.model
    torch_only = LlamaModel(tiny_engine.hf_model, native_kernels=False)
    return [m for m in (fast, torch_only) if m is not None]


def _run(model, feed: list[int], tree: list[tuple[int, int, int]] | None):
    cache = model.new_cache(1, 64)
    model.forward(torch.tensor([PROMPT]), cache, [0])
    mask = None if tree is None else TreeMask.from_rows(tree)
    hidden = model.forward(torch.tensor([feed]), cache, [0], tree=mask)[0]
    return model.logits(hidden), cache


@pytest.mark.parametrize("which", ["kernels", "torch"])
def test_tree_path_gets_the_chain_logits(tiny_engine, which):
    """Each node sees only its ancestors: the path a, b, c of the tree gets the logits a chain
    root, a, b, c gets (the same bits on the engine's kernels), and so does the root."""
    model = _models(tiny_engine)[0 if which == "kernels" else 1]
    if which == "kernels" and model.attention_kernels is None:
        pytest.skip("the engine's CPU kernels are unavailable here")
    root = 11
    chain_logits, _ = _run(model, [root, A, B, C], None)
    tree_logits, _ = _run(model, [root, *TOKENS], tree_rows(len(PROMPT), PARENTS))
    rows = [0] + [1 + i for i in PATH]
    if which == "kernels":
        assert torch.equal(tree_logits[rows], chain_logits)
    else:
        torch.testing.assert_close(tree_logits[rows], chain_logits, rtol=1e-5, atol=1e-5)
    # x's branch: root, x, z as a chain
    side, _ = _run(model, [root, X, Z], None)
    torch.testing.assert_close(tree_logits[[0, 1, 6]], side, rtol=1e-5, atol=1e-5)


def test_keeping_the_path_continues_like_the_chain(tiny_engine):
    model = tiny_engine.model
    root = 11
    _, chain_cache = _run(model, [root, A, B, C], None)
    _, tree_cache = _run(model, [root, *TOKENS], tree_rows(len(PROMPT), PARENTS))
    start = len(PROMPT)
    tree_cache.keep(0, [start + 1 + i for i in PATH], start + 1)
    tree_cache.lengths[0] = chain_cache.lengths[0] = start + 1 + len(PATH)
    after_chain = model.logits(model.forward(torch.tensor([[9, 10]]), chain_cache, [0])[0])
    after_tree = model.logits(model.forward(torch.tensor([[9, 10]]), tree_cache, [0])[0])
    assert torch.equal(after_chain, after_tree)


def test_mask_rows():
    start = 10
    rows = tree_rows(start, PARENTS)
    assert rows[0] == (start + 1, 0, start)  # the root is a plain row
    assert [r[2] - start for r in rows[1:]] == depths(PARENTS) == [1, 1, 2, 2, 3, 2]
    mask = TreeMask.from_rows(rows)
    assert mask.visible(5, start + 5) == [*range(start + 1), start + 2, start + 4, start + 5]  # c: a, b, c
    assert mask.visible(6, start + 6) == [*range(start + 1), start + 1, start + 6]  # z: x, z
    plain = TreeMask.from_rows(plain_rows(start, 3))
    assert plain.visible(2, start + 2) == list(range(start + 3))
    check_parents(PARENTS)
    for bad in ([0], [-1, 2, 0], [-2]):
        with pytest.raises(ValueError, match="parent"):
            check_parents(bad)
    with pytest.raises(ValueError, match="at most"):
        check_parents([-1] * 64)


def test_greedy_tree_verification_follows_the_argmax():
    # rows: root, x, a, y, b, c, z. Target: after root -> a, after a -> b, after b -> 9 (no child)
    argmax = [A, 0, B, 0, 9, 0, 0]
    verdict = verify_tree_greedy(argmax, TOKENS, PARENTS)
    assert verdict.path == [1, 3] and verdict.next_token == 9
    assert verdict.emitted(TOKENS) == [A, B, 9]
    # the whole path accepted: the bonus token comes from the last node's row
    argmax = [A, 0, B, 0, C, 77, 0]
    assert verify_tree_greedy(argmax, TOKENS, PARENTS).emitted(TOKENS) == [A, B, C, 77]
    # nothing matches: one token from the root's row
    assert verify_tree_greedy([5] * 7, TOKENS, PARENTS).emitted(TOKENS) == [5]


def _first_two(p, tokens, parents, n, seed, verify=verify_tree_sampled):
    gen = torch.Generator().manual_seed(seed)
    counts: dict[tuple[int, int], int] = {}
    for _ in range(n):
        verdict = verify(p, tokens, parents, gen)
        out = verdict.emitted(tokens)
        if len(out) < 2:  # the second token as the next round would draw it (a Markov target)
            out.append(int(torch.multinomial(P_AFTER[out[0]], 1, generator=gen)))
        key = (out[0], out[1])
        counts[key] = counts.get(key, 0) + 1
    return counts


V = 5
_gen = torch.Generator().manual_seed(3)
P_AFTER = torch.rand(V, V, generator=_gen) ** 2 + 0.01  # a Markov target: row = previous token
P_AFTER = P_AFTER / P_AFTER.sum(-1, keepdim=True)
ROOT = 0
# root's children 1, 2, 3 (top-3 style), 1's children 2, 4, 2's child 0
SMALL_TOKENS = [1, 2, 3, 2, 4, 0]
SMALL_PARENTS = [-1, -1, -1, 0, 0, 1]


def _tree_probs() -> torch.Tensor:
    rows = [P_AFTER[ROOT]] + [P_AFTER[t] for t in SMALL_TOKENS]
    return torch.stack(rows)


def _p_value(counts, n) -> float:
    keys = [(a, b) for a in range(V) for b in range(V)]
    expected = [float(P_AFTER[ROOT, a] * P_AFTER[a, b]) for a, b in keys]
    expected = [e * n / sum(expected) for e in expected]
    return float(chisquare([counts.get(k, 0) for k in keys], expected).pvalue)


def test_sampled_tree_verification_is_exact():
    """The first two emitted tokens follow the target's joint distribution."""
    n = 20000
    counts = _first_two(_tree_probs(), SMALL_TOKENS, SMALL_PARENTS, n, seed=1)
    assert _p_value(counts, n) > 1e-3


def test_a_broken_tree_sampler_is_caught():
    """Drawing the recovered token from p, not from the residual, biases the output."""
    def broken(p, tokens, parents, generator):
        verdict = verify_tree_sampled(p, tokens, parents, generator)
        if verdict.path:
            return verdict
        return type(verdict)([], int(torch.multinomial(p[0], 1, generator=generator)))

    n = 20000
    counts = _first_two(_tree_probs(), SMALL_TOKENS, SMALL_PARENTS, n, seed=2, verify=broken)
    assert _p_value(counts, n) < 1e-6
