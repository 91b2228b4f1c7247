"""The rejection rule, checked on the engine's own code: verify_sampled's exact output distribution
(enumerated from its own random calls) against the definition of lossless drafting, the residual on
hand-worked cases, and verify_sampled emitting the target at every draft position (Monte Carlo)."""

from __future__ import annotations

import torch

from openalice_runner.engine.rejection import residual_distribution, verify_greedy, verify_sampled


class _Branch(Exception):
    """A choice point the path being replayed has not decided yet."""

    def __init__(self, weights: list[float]) -> None:
        self.weights = weights


class _Path:
    """One path of random choices, replayed through the engine's code: each draw takes the next
    choice, weighted by the probability the engine's own call gave it."""

    def __init__(self, choices: tuple[int, ...]) -> None:
        self.choices, self.at, self.weight = choices, 0, 1.0

    def choose(self, weights: list[float]) -> int:
        if self.at == len(self.choices):
            raise _Branch(weights)
        choice = self.choices[self.at]
        self.at += 1
        self.weight *= weights[choice]
        return choice


U_STEPS = 200  # the engine's uniform draw, enumerated on this many midpoints of [0, 1)


class _TorchWithRand:
    """The torch module to rejection.py, with `rand` answered by the path being replayed."""

    def __init__(self, rand) -> None:
        self.rand = rand

    def __getattr__(self, name):
        return getattr(torch, name)


def engine_round_outcomes(monkeypatch, p: torch.Tensor, q: torch.Tensor | None, draft: list[int] | None,
                          k: int) -> dict[tuple[int, ...], float]:
    """The exact distribution of what the engine's verify_sampled emits in one round, by running it
    once per path of its random choices: the draft (drawn from q when `draft` is None), each of its
    `sample` calls (every token, weighted by the distribution the engine passed) and each uniform
    (U_STEPS midpoints, 1/U_STEPS each). Nothing of the rule is assumed: whatever the engine
    compares, samples from or returns is what gets counted."""
    from openalice_runner.engine import rejection

    now: dict[str, _Path] = {}
    monkeypatch.setattr(rejection, "sample", lambda probs, generator: now["path"].choose(probs.double().tolist()))
    monkeypatch.setattr(rejection, "torch", _TorchWithRand(
        lambda *args, generator=None, **kwargs: torch.tensor(
            (now["path"].choose([1.0 / U_STEPS] * U_STEPS) + 0.5) / U_STEPS, dtype=torch.float64)))
    outcomes: dict[tuple[int, ...], float] = {}
    todo: list[tuple[int, ...]] = [()]
    while todo:
        path = _Path(todo.pop())
        now["path"] = path
        try:
            tokens = draft if draft is not None else [path.choose(q[i].tolist()) for i in range(k)]
            emitted = tuple(rejection.verify_sampled(p, q, list(tokens), None).emitted(list(tokens)))
        except _Branch as branch:
            todo.extend(path.choices + (i,) for i, w in enumerate(branch.weights) if w > 0)
            continue
        outcomes[emitted] = outcomes.get(emitted, 0.0) + path.weight
    return outcomes


def random_dist(vocab: int, gen: torch.Generator, sparsity: float = 0.0) -> torch.Tensor:
    x = torch.rand(vocab, generator=gen, dtype=torch.float64) ** 3
    if sparsity:
        x[torch.rand(vocab, generator=gen) < sparsity] = 0.0
        if x.sum() == 0:
            x[0] = 1.0
    return x / x.sum()


def _first_token(outcomes: dict[tuple[int, ...], float], vocab: int) -> torch.Tensor:
    first = torch.zeros(vocab, dtype=torch.float64)
    for emitted, weight in outcomes.items():
        first[emitted[0]] += weight
    return first


def test_the_engines_round_emits_the_target_distribution_with_a_sampled_draft(monkeypatch):
    """Against the definition, not the formula: with x ~ q, the engine's first emitted token is
    distributed as p[0] (lossless), its draft is accepted with probability sum_x min(p(x), q(x))
    (the most any lossless rule can accept), and the bonus after an accepted draft follows p[1]."""
    gen = torch.Generator().manual_seed(0)
    tol = 1.0 / U_STEPS + 1e-9  # the uniform's grid moves at most 1/U_STEPS of a draft's mass
    for trial in range(6):
        vocab = 4
        p = torch.stack([random_dist(vocab, gen, sparsity=0.3 if trial % 2 else 0.0) for _ in range(2)])
        q = random_dist(vocab, gen, sparsity=0.3 if trial % 3 else 0.0)[None]
        outcomes = engine_round_outcomes(monkeypatch, p, q, None, 1)
        assert abs(sum(outcomes.values()) - 1.0) < 1e-9
        first = _first_token(outcomes, vocab)
        assert torch.allclose(first, p[0], atol=tol), (trial, p[0], q[0], first)
        accepted = sum(w for emitted, w in outcomes.items() if len(emitted) == 2)
        assert abs(accepted - float(torch.minimum(p[0], q[0]).sum())) <= tol, (trial, accepted)
        bonus = torch.zeros(vocab, dtype=torch.float64)
        for emitted, w in outcomes.items():
            if len(emitted) == 2:
                bonus[emitted[1]] += w
        if accepted > 0:
            assert torch.allclose(bonus / accepted, p[1], atol=1e-9), (trial, bonus / accepted, p[1])


def test_the_engines_round_with_a_one_hot_draft_is_plain_decoding_cut_at_the_first_miss(monkeypatch):
    """A deterministic draft (q=None): each emitted token follows its row of p, the round going on
    only while the token is the drafted one. The reference is that sequence's probability, product
    by product; the engine's is enumerated from its own calls (exact: no uniform in this rule)."""
    gen = torch.Generator().manual_seed(1)
    for trial in range(6):
        vocab, k = 4, 3
        p = torch.stack([random_dist(vocab, gen, sparsity=0.2) for _ in range(k + 1)])
        draft = [int(torch.randint(0, vocab, (1,), generator=gen)) for _ in range(k)]
        outcomes = engine_round_outcomes(monkeypatch, p, None, draft, k)
        want: dict[tuple[int, ...], float] = {}
        for m in range(k + 1):  # m drafts accepted, then token t at position m
            reach = float(torch.prod(torch.tensor([p[j, draft[j]] for j in range(m)], dtype=torch.float64)))
            for t in range(vocab):
                if (m == k or t != draft[m]) and reach * p[m, t] > 0:
                    want[(*draft[:m], t)] = reach * float(p[m, t])
        assert set(outcomes) == set(want), (trial, sorted(outcomes), sorted(want))
        assert all(abs(outcomes[e] - want[e]) < 1e-12 for e in want), (trial, outcomes, want)


def test_a_round_that_resamples_the_target_after_a_rejection_is_caught(monkeypatch):
    """The enumeration can fail: an engine drawing the recovered token from p (not the residual)
    over-weights the draft's likely tokens, and the first test's check sees it."""
    from openalice_runner.engine import rejection

    monkeypatch.setattr(rejection, "residual_distribution", lambda p, q, token: p)
    p = torch.tensor([[0.5, 0.3, 0.2], [0.2, 0.3, 0.5]], dtype=torch.float64)
    q = torch.tensor([[0.2, 0.5, 0.3]], dtype=torch.float64)
    first = _first_token(engine_round_outcomes(monkeypatch, p, q, None, 1), 3)
    assert not torch.allclose(first, p[0], atol=1.0 / U_STEPS + 1e-9), first


def test_zero_draft_probability_is_guarded():
    # The draft proposed x although q(x) = 0: accepted iff p(x) > 0, never a division by zero.
    p = torch.tensor([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]])
    q = torch.tensor([[1.0, 0.0, 0.0]])
    gen = torch.Generator().manual_seed(0)
    assert verify_sampled(p, q, [1], gen).accepted == 1
    q_zero_both = torch.tensor([[1.0, 0.0, 0.0]])
    verdict = verify_sampled(p, q_zero_both, [2], gen)  # p(2) = 0 too: always rejected
    assert verdict.accepted == 0 and verdict.next_token in (0, 1)


def test_greedy_verification_vocabulary():
    # target argmax after each prefix: [5, 6, 7, 8]; draft [5, 6, 9]
    v = verify_greedy([5, 6, 7, 8], [5, 6, 9])
    assert (v.accepted, v.next_token) == (2, 7)  # two accepted, recovered token 7
    assert v.emitted([5, 6, 9]) == [5, 6, 7]
    v = verify_greedy([5, 6, 7, 8], [5, 6, 7])
    assert (v.accepted, v.next_token) == (3, 8)  # all accepted, bonus token 8
    v = verify_greedy([1], [])
    assert (v.accepted, v.next_token) == (0, 1)  # nothing proposed: plain decode


def test_sampled_round_matches_target_marginal():
    # Monte Carlo over whole rounds: the first emitted token is distributed as p[0].
    gen = torch.Generator().manual_seed(3)
    vocab = 6
    p = torch.stack([random_dist(vocab, gen) for _ in range(3)]).float()
    q = torch.stack([random_dist(vocab, gen) for _ in range(2)]).float()
    counts = torch.zeros(vocab)
    n = 20000
    for _ in range(n):
        draft = [int(torch.multinomial(q[0], 1, generator=gen)), int(torch.multinomial(q[1], 1, generator=gen))]
        v = verify_sampled(p, q, draft, gen)
        counts[v.emitted(draft)[0]] += 1
    assert torch.allclose(counts / n, p[0], atol=0.015)


def test_residual_on_hand_computed_cases():
    # norm(max(0, p - q)) worked by hand, not by the formula again
    cases = [
        ([0.5, 0.3, 0.2], [0.2, 0.5, 0.3], 1, [1.0, 0.0, 0.0]),  # only token 0 has p > q: 0.3 / 0.3
        ([0.4, 0.4, 0.2], [0.1, 0.3, 0.6], 2, [0.75, 0.25, 0.0]),  # 0.3, 0.1 over 0.4
        ([0.25, 0.25, 0.5], [0.25, 0.25, 0.5], 0, [0.25, 0.25, 0.5]),  # p == q: p itself
    ]
    for p, q, x, want in cases:
        got = residual_distribution(torch.tensor(p, dtype=torch.float64), torch.tensor(q, dtype=torch.float64), x)
        assert torch.allclose(got, torch.tensor(want, dtype=torch.float64), atol=1e-12), (p, q, got)
    # one-hot q at token 0: p without it, 0.3 and 0.2 over 0.5
    got = residual_distribution(torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64), None, 0)
    assert torch.allclose(got, torch.tensor([0.0, 0.6, 0.4], dtype=torch.float64), atol=1e-12)


def _rounds_by_position(n: int, seed: int) -> tuple[torch.Tensor, list[list[int]]]:
    """Runs the engine's verify_sampled (looked up on the module, so a monkeypatch reaches it) on
    n rounds of a 3-token draft drawn from q; returns p and, per position j, the token each round
    that reached j emitted there."""
    from openalice_runner.engine import rejection

    gen = torch.Generator().manual_seed(seed)
    vocab = 5
    p = torch.stack([random_dist(vocab, gen) for _ in range(4)]).float()
    # q near p (as a useful drafter's is), so that rounds often reach the later positions
    q = torch.stack([0.6 * p[i] + 0.4 * random_dist(vocab, gen).float() for i in range(3)])
    at: list[list[int]] = [[] for _ in range(4)]
    for _ in range(n):
        draft = [int(torch.multinomial(q[i], 1, generator=gen)) for i in range(3)]
        emitted = rejection.verify_sampled(p, q, draft, gen).emitted(draft)
        for j, token in enumerate(emitted):
            at[j].append(token)
    return p, at


def _positions_p(p: torch.Tensor, at: list[list[int]]) -> float:
    """Given the round reached position j, its token there follows p[j] (draft tokens are drawn
    independently per row): one Pearson test per position, summed."""
    from scipy.stats import chi2

    stat, df = 0.0, 0
    for j, tokens in enumerate(at):
        counts = torch.bincount(torch.tensor(tokens), minlength=p.shape[1]).double()
        expected = p[j].double() * len(tokens)
        stat += float(((counts - expected) ** 2 / expected).sum())
        df += p.shape[1] - 1
    return float(chi2.sf(stat, df))


def test_engine_rounds_emit_the_target_at_every_position():
    p, at = _rounds_by_position(10000, seed=5)
    assert min(len(t) for t in at) > 1000  # every position, the bonus's included, was reached often
    assert _positions_p(p, at) > 1e-3


def test_engine_rounds_with_a_late_residual_from_the_wrong_row_are_caught(monkeypatch):
    from openalice_runner.engine import rejection

    real = rejection.residual_distribution
    rows = {}

    def wrong_row(p_row, q_row, token):  # rows 1+ take row 0's residual
        return real(rows["p"][0], rows["q"][0], token) if p_row.data_ptr() != rows["p"].data_ptr() else real(
            p_row, q_row, token)

    verify = rejection.verify_sampled

    def spy(p, q, draft, draws, position=0):
        rows.update(p=p, q=q)
        return verify(p, q, draft, draws, position)

    monkeypatch.setattr(rejection, "residual_distribution", wrong_row)
    monkeypatch.setattr(rejection, "verify_sampled", spy)
    p, at = _rounds_by_position(10000, seed=5)
    assert _positions_p(p, at) < 1e-6
