"""The rejection rule: its defining identity against a plain reference, the residual on hand-worked
cases, and the engine's own verify_sampled emitting the target at every draft position."""

from __future__ import annotations

import torch

from openalice_runner.engine.rejection import residual_distribution, verify_greedy, verify_sampled


def reference_output_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Distribution of the first emitted token of one round with one draft token x ~ q:
    sum_x q(x) min(1, p(x)/q(x)) [token = x] + rejected mass * residual."""
    accept = torch.where(q > 0, torch.minimum(torch.ones_like(p), p / q.clamp_min(1e-30)), torch.zeros_like(p))
    accepted_mass = q * accept
    rejected = 1.0 - accepted_mass.sum()
    residual = torch.clamp(p - q, min=0.0)
    residual = residual / residual.sum() if residual.sum() > 0 else p
    return accepted_mass + rejected * residual


def random_dist(vocab: int, gen: torch.Generator, sparsity: float = 0.0) -> torch.Tensor:
    x = torch.rand(vocab, generator=gen, dtype=torch.float64) ** 3
    if sparsity:
        x[torch.rand(vocab, generator=gen) < sparsity] = 0.0
        if x.sum() == 0:
            x[0] = 1.0
    return x / x.sum()


def test_identity_holds_on_random_distributions():
    gen = torch.Generator().manual_seed(0)
    for trial in range(200):
        vocab = int(torch.randint(2, 50, (1,), generator=gen))
        p = random_dist(vocab, gen, sparsity=0.3 if trial % 2 else 0.0)
        q = random_dist(vocab, gen, sparsity=0.3 if trial % 3 else 0.0)
        out = reference_output_distribution(p, q)
        assert torch.allclose(out, p, atol=1e-6), (p, q, out)
        # the module's residual is the reference's residual
        for x in range(vocab):
            if q[x] > 0 and p[x] < q[x]:
                r = residual_distribution(p, q, x)
                ref = torch.clamp(p - q, min=0.0)
                assert torch.allclose(r, ref / ref.sum(), atol=1e-12)


def test_identity_with_one_hot_draft():
    gen = torch.Generator().manual_seed(1)
    for _ in range(100):
        vocab = int(torch.randint(2, 40, (1,), generator=gen))
        p = random_dist(vocab, gen, sparsity=0.2)
        x = int(torch.randint(0, vocab, (1,), generator=gen))
        # one-hot q at x: accept with probability p(x); residual is p with x zeroed
        accepted = torch.zeros_like(p)
        accepted[x] = p[x]
        residual = residual_distribution(p, None, x)
        out = accepted + (1 - p[x]) * residual
        assert torch.allclose(out, p, atol=1e-6)
        assert residual[x] == 0 or p[x] == 1.0


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
