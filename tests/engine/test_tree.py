"""Draft trees: tree attention in one pass, the accepted path's cache, and tree verification.

The exactness of sampled tree drafting through the decode loop is tested in
engine/grammar/test_sampling_exact.py; greedy equality with `off` in engine/test_eagle.py.
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


def _first_three(p, tokens, parents, n, seed, verify=verify_tree_sampled):
    """The first three emitted tokens of n rounds over one tree (the tokens a round did not reach
    drawn as the next rounds would: a Markov target), and how many tokens each round accepted."""
    gen = torch.Generator().manual_seed(seed)
    counts: dict[tuple[int, int, int], int] = {}
    accepted = [0, 0, 0]
    for _ in range(n):
        verdict = verify(p, tokens, parents, gen)
        accepted[verdict.accepted] += 1
        out = verdict.emitted(tokens)
        while len(out) < 3:
            out.append(int(torch.multinomial(P_AFTER[out[-1]], 1, generator=gen)))
        key = (out[0], out[1], out[2])
        counts[key] = counts.get(key, 0) + 1
    return counts, accepted


V = 5
_gen = torch.Generator().manual_seed(3)
P_AFTER = torch.rand(V, V, generator=_gen) ** 2 + 0.01  # a Markov target: row = previous token
P_AFTER = P_AFTER / P_AFTER.sum(-1, keepdim=True)
ROOT = 0
# root's children 1, 2, 3 (top-3 style), 1's children 2, 4, 2's child 0: depth 2
SMALL_TOKENS = [1, 2, 3, 2, 4, 0]
SMALL_PARENTS = [-1, -1, -1, 0, 0, 1]


def _tree_probs() -> torch.Tensor:
    rows = [P_AFTER[ROOT]] + [P_AFTER[t] for t in SMALL_TOKENS]
    return torch.stack(rows)


def _p_value(counts, n) -> float:
    keys = [(a, b, c) for a in range(V) for b in range(V) for c in range(V)]
    expected = [float(P_AFTER[ROOT, a] * P_AFTER[a, b] * P_AFTER[b, c]) for a, b, c in keys]
    expected = [e * n / sum(expected) for e in expected]
    return float(chisquare([counts.get(k, 0) for k in keys], expected).pvalue)


@pytest.mark.usefixtures("one_thread")
def test_sampled_tree_verification_is_exact():
    """The first three emitted tokens follow the target's joint distribution: rounds rejected at
    the root's children, at depth 2 after an acceptance, and whole paths with their bonus token."""
    n = 20000
    counts, accepted = _first_three(_tree_probs(), SMALL_TOKENS, SMALL_PARENTS, n, seed=1)
    # every depth of the tree reached: no acceptance, a rejection at depth 2, the whole path + bonus
    assert min(accepted) > n // 20, accepted
    assert _p_value(counts, n) > 1e-3


@pytest.mark.usefixtures("one_thread")
def test_a_broken_tree_sampler_is_caught():
    """Drawing the recovered token from p, not from the residual, biases the output."""
    def broken(p, tokens, parents, generator):
        verdict = verify_tree_sampled(p, tokens, parents, generator)
        if verdict.path:
            return verdict
        return type(verdict)([], int(torch.multinomial(p[0], 1, generator=generator)))

    n = 5000  # p about 1e-202 at this n
    counts, _ = _first_three(_tree_probs(), SMALL_TOKENS, SMALL_PARENTS, n, seed=2, verify=broken)
    assert _p_value(counts, n) < 1e-6


@pytest.mark.usefixtures("one_thread")
def test_a_tree_sampler_that_drops_the_bonus_after_a_whole_path_is_caught():
    """A fault only after a depth-2 accept: the bonus token replaced by a draw from the root's row."""
    def no_bonus(p, tokens, parents, generator):
        verdict = verify_tree_sampled(p, tokens, parents, generator)
        if verdict.accepted < 2:
            return verdict
        return type(verdict)(verdict.path, int(torch.multinomial(p[0], 1, generator=generator)))

    n = 5000  # p below 1e-300 at this n
    counts, accepted = _first_three(_tree_probs(), SMALL_TOKENS, SMALL_PARENTS, n, seed=4, verify=no_bonus)
    assert accepted[2] > n // 20, accepted
    assert _p_value(counts, n) < 1e-6


# ---- growing and choosing a tree (drafters/eagle_tree.py) -------------------------------------
class FakeHead:
    """Every feature row gets the same next-token distribution; steps are recorded."""

    PROBS = [0.5, 0.2, 0.12, 0.08, 0.05, 0.03, 0.02]

    def __init__(self):
        self.vocab = torch.arange(100, 100 + len(self.PROBS))
        self.calls = []

    def logits(self, feats):
        return torch.tensor(self.PROBS).log().expand(feats.shape[0], -1)

    def step(self, cache, feats, tokens, positions, tree):
        self.calls.append((tokens, positions, tree))
        return feats + 1.0


def test_growing_a_tree_expands_the_best_nodes_with_ancestor_masks():
    from openalice_runner.engine.drafters.eagle_tree import grow

    head = FakeHead()
    last = 10
    nodes, steps = grow(head, None, torch.zeros(1, 4), last, max_depth=3, max_rows=20)
    assert steps == 2 == len(head.calls)
    assert [n.score for n in nodes[:4]] == pytest.approx([0.5, 0.2, 0.12, 0.08])  # depth 1: the top 4
    # depth 2 expands the 3 best depth-1 nodes: rows 0, 1, 2 of the head cache, past `last`
    tokens, positions, mask = head.calls[0]
    assert tokens == [100, 101, 102] and positions == [11, 12, 13]
    assert mask.rope_pos.tolist() == [11, 11, 11] and mask.bits.tolist() == [1, 2, 4]
    # depth 3 expands the 3 best depth-2 nodes; each row sees its parent's row and its own
    tokens, positions, mask = head.calls[1]
    expanded = [n for n in nodes if n.depth == 2 and n.head_row >= 0]
    assert [n.score for n in expanded] == pytest.approx([0.25, 0.1, 0.1])
    assert positions == [14, 15, 16] and mask.rope_pos.tolist() == [12, 12, 12]
    parent_rows = [nodes[n.parent].head_row for n in expanded]
    assert mask.bits.tolist() == [(1 << p) | (1 << (3 + k)) for k, p in enumerate(parent_rows)]
    for i, n in enumerate(nodes):  # parents first, scores multiply down the path
        if n.parent >= 0:
            assert n.parent < i and n.score <= nodes[n.parent].score and n.depth == nodes[n.parent].depth + 1
    # a cap of one depth takes no head step
    head = FakeHead()
    nodes, steps = grow(head, None, torch.zeros(1, 4), last, max_depth=1, max_rows=20)
    assert steps == 0 and len(nodes) == 4


def test_choosing_nodes_keeps_a_tree_and_follows_the_value():
    from openalice_runner.engine.drafters.eagle_tree import grow, select

    nodes, _ = grow(FakeHead(), None, torch.zeros(1, 4), 10, max_depth=4, max_rows=20)
    tokens, parents = select(nodes, 6)
    assert len(tokens) == 6
    check_parents(parents)  # every parent chosen, and before its children
    # the best six: 0.5, 0.25, 0.2, 0.125, 0.12, 0.1 (a chain of top tokens, and the runners-up)
    assert depths(parents).count(1) >= 2 and max(depths(parents)) >= 3

    def per_node(cost):  # tokens per unit cost when each node costs `cost` of a pass
        return lambda n, expected, depth: (1 + expected) / (1 + cost * n)

    assert len(select(nodes, 8, per_node(0.01))[0]) == 8
    few = select(nodes, 8, per_node(0.3))[0]
    assert 0 < len(few) < 8
    assert select(nodes, 8, per_node(5.0)) == ([], [])  # no tree beats decoding alone


def test_growth_stops_where_another_depth_cannot_pay():
    from openalice_runner.engine.drafters.eagle_tree import grow

    head = FakeHead()
    grow(head, None, torch.zeros(1, 4), 10, max_depth=5, max_rows=20, max_nodes=60,
         value=lambda n, expected, depth: (1 + expected) / (1 + 0.001 * n + 0.001 * (depth - 1)))
    cheap = len(head.calls)
    head = FakeHead()
    grow(head, None, torch.zeros(1, 4), 10, max_depth=5, max_rows=20, max_nodes=60,
         value=lambda n, expected, depth: (1 + expected) / (1 + 0.02 * n + 0.5 * (depth - 1)))
    assert len(head.calls) < cheap == 4


def test_cutting_a_tree_proposal():
    from openalice_runner.engine.drafters.base import Proposal

    tree = Proposal(TOKENS, None, parents=PARENTS)
    cut = tree.cut(max_depth=2, max_nodes=10)
    assert cut.tokens == [X, A, Y, B, Z] and cut.parents == [-1, -1, 1, 1, 0]
    cut = tree.cut(max_depth=3, max_nodes=3)
    assert cut.tokens == [X, A, Y] and cut.parents == [-1, -1, 1]
    chain = Proposal([1, 2, 3, 4])
    assert chain.cut(2, 10).tokens == [1, 2] and chain.cut(2, 10).parents is None


def test_serial_engine_trees_equal_off(tmp_path):
    """The one-at-a-time decode loop verifies trees too (the batched one is in test_engine_eagle)."""
    from openalice_runner.engine import Engine, SamplingParams, SpecConfig
    from openalice_runner.engine.drafters.eagle import EagleDrafter
    from openalice_runner.engine.eagle.head import EagleHead, EagleRuntime, HeadConfig

    engine = Engine.tiny_random(seed=0, max_batch=1)
    assert engine.scheduler is None
    model = engine.model
    cfg = HeadConfig.for_target("tiny-random", model, list(range(model.cfg.vocab_size)))
    head = EagleHead(cfg)
    head.init_from_target(model)  # untrained: drafts are often wrong, and so paths are short
    runtime = EagleRuntime(head.eval(), model)
    prompt = engine.encode("The quick brown fox jumps over the lazy dog. The quick brown fox")
    plain = engine.generate(prompt, SamplingParams(max_tokens=40))
    for nodes in (3, 10):
        drafter = EagleDrafter(runtime, 256, model.cfg.vocab_size, tree_nodes=nodes)
        out = engine.generate(prompt, SamplingParams(max_tokens=40), SpecConfig(method="eagle", gamma=4),
                              drafter=drafter)
        assert out.token_ids == plain.token_ids
        assert out.stats.proposed > out.stats.target_passes  # several candidates a round


def test_a_tree_is_cut_to_the_room_in_the_cache():
    from types import SimpleNamespace

    from openalice_runner.engine import SamplingParams, SpecConfig
    from openalice_runner.engine.drafters.base import Drafter, Proposal
    from openalice_runner.engine.round import plan_round
    from openalice_runner.engine.sequence import SequenceRequest, Target, begin, new_sequence

    class Wide(Drafter):
        def propose(self, history, gamma, sampling, generator):
            return Proposal(list(range(10, 30)), None, parents=[-1] * 20)

    class Quiet:
        def decode(self, ids, skip_special_tokens=True):
            return ""

    cache = SimpleNamespace(max_len=12, lengths=[0])
    seq = new_sequence(SequenceRequest([1, 2, 3, 4, 5], SamplingParams(max_tokens=50),
                                       SpecConfig(method="eagle", gamma=4), Wide()),
                       Target(cache, Quiet(), frozenset(), context_length=64))
    begin(seq)
    planned = plan_round(seq, 4)
    assert len(planned.draft) == 12 - 5  # positions 5..11: the root's successors that the cache holds
    assert planned.proposal.parents == [-1] * 7
