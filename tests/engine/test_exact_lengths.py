"""Sampling exactness at every draft length (issue 32).

The target is a second-order Markov chain read from its cache (stand_ins/pair_chain.py), the
replies are γ + 2 tokens or longer, so every round can draft its full γ, and each test shows
from the engine's own statistics (GenerationStats.draft_depth_histogram) that full-length
drafts, acceptances at draft positions 2 and later, and late rejections happened, with counts.
The reference is written again in plain Python (checked first against hand-computed
distributions); the test is the sequential chi-square of the stand-in module. Negative controls
break the code path that runs, only at draft positions 2 and later, and must fail at p < 1e-6.
docs/testing.md gives the smallest deviation each test detects.
"""

from __future__ import annotations

import math

import pytest
import torch
from stand_ins.pair_chain import (
    GRAMMAR_ROWS,
    HIDDEN,
    PROMPT,
    VOCAB,
    PairDrafter,
    PairModel,
    Rounds,
    Run,
    chain_constraint,
    check_lengths,
    grammar_drafts,
    moved_rows,
    plain_probs,
    random_eagle3_runtime,
    random_eagle_runtime,
    random_pair_chain,
    reference_rows,
    report,
    sample_batched,
    sample_reference,
    sample_serial,
    sequential_chi_square,
)

from openalice_runner.engine import rejection, settle
from openalice_runner.engine.sampling import processed_probs
from openalice_runner.engine.types import SamplingParams, SpecConfig

N = 2500
DETECTABLE_TV = 0.045  # per position, at positions 3+: power 0.9 at N, worst direction (docs/testing.md)


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors (conftest.py)


# ---- the reference, by hand ----------------------------------------------------------------------
def test_plain_reference_matches_hand_computed_distributions():
    logits = [math.log(x) for x in (0.5, 0.3, 0.2)]
    close = lambda a, b: all(abs(x - y) < 1e-12 for x, y in zip(a, b, strict=True))  # noqa: E731
    assert close(plain_probs(logits, 1.0), [0.5, 0.3, 0.2])
    # temperature 0.5 squares the probabilities before renormalising: 0.25, 0.09, 0.04 over 0.38
    assert close(plain_probs(logits, 0.5), [0.25 / 0.38, 0.09 / 0.38, 0.04 / 0.38])
    # top-k 2 keeps 0.5 and 0.3: 5/8, 3/8
    assert close(plain_probs(logits, 1.0, top_k=2), [0.625, 0.375, 0.0])
    assert close(plain_probs(logits, 1.0, top_k=1), [1.0, 0.0, 0.0])
    # top-p 0.7: the mass before 0.3 is 0.5 < 0.7 (kept), before 0.2 it is 0.8 (dropped)
    assert close(plain_probs(logits, 1.0, top_p=0.7), [0.625, 0.375, 0.0])
    # top-p 0.5: the mass before the second token is exactly 0.5, so only the first stays
    assert close(plain_probs([math.log(x) for x in (0.5, 0.25, 0.25)], 1.0, top_p=0.5), [1.0, 0.0, 0.0])
    # top-k then top-p: of 0.5, 0.3 (renormalised 0.625, 0.375) top-p 0.6 keeps only the first
    assert close(plain_probs(logits, 1.0, top_k=2, top_p=0.6), [1.0, 0.0, 0.0])
    # a grammar's mask first: 0.3 and 0.2 left, 0.6 and 0.4
    assert close(plain_probs(logits, 1.0, allowed=[False, True, True]), [0.0, 0.6, 0.4])
    # ties at the k-th score are kept
    assert close(plain_probs([0.0, 0.0, -1.0], 1.0, top_k=1), [0.5, 0.5, 0.0])


def test_engine_processing_agrees_with_the_plain_reference():
    # the engine's processed_probs on the chain's rows, for every configuration the tests use
    table = random_pair_chain(1)
    for t, k, p in [(0.9, 0, 1.0), (0.9, 3, 1.0), (0.7, 0, 0.8), (1.3, 2, 0.9), (0.9, 3, 0.8)]:
        sampling = SamplingParams(temperature=t, top_k=k, top_p=p)
        rows = reference_rows(table, sampling)
        engine = processed_probs(table.log(), sampling).tolist()
        for (a, b), row in rows.items():
            assert all(abs(x - y) < 1e-5 for x, y in zip(row, engine[a * VOCAB + b], strict=True)), (t, k, p, a, b)


def test_the_test_keeps_its_level_and_has_the_power_docs_state():
    """On replies drawn straight from the reference rows the p-values are about uniform; where
    every row from reply position 3 on moves by DETECTABLE_TV in total variation (docs/testing.md:
    the test detects that at power 0.9), the test fails."""
    table = random_pair_chain(1)
    sampling = SamplingParams(temperature=0.9, top_k=3)
    rows = reference_rows(table, sampling)
    ps = [sequential_chi_square(sample_reference(rows, PROMPT, 6, N, seed), rows).p for seed in range(40)]
    assert sum(p < 0.01 for p in ps) <= 3 and 8 <= sum(p < 0.5 for p in ps) <= 32, ps
    moved = moved_rows(rows, DETECTABLE_TV)
    caught = [sequential_chi_square(sample_reference(rows, PROMPT, 6, N, seed, moved, 2), rows).p < 1e-3
              for seed in range(100, 120)]
    print(f"null p below 0.01: {sum(p < 0.01 for p in ps)}/40, below 0.5: {sum(p < 0.5 for p in ps)}/40; "
          f"moved by {DETECTABLE_TV}: caught {sum(caught)}/20")
    assert sum(caught) >= 15, caught


# ---- the plain chain, sampled and one-hot drafts, top-k and top-p -------------------------------
CHAIN_CONFIGS = [
    pytest.param(gamma, k, p, det, id=f"gamma{gamma}-topk{k}-topp{p}-{'onehot' if det else 'sampled'}")
    for gamma, k, p, det in [(1, 3, 1.0, False), (2, 0, 1.0, True), (3, 3, 1.0, False), (3, 0, 0.8, True),
                             (5, 0, 0.8, False), (5, 3, 0.9, True)]
]


@pytest.mark.parametrize(("gamma", "top_k", "top_p", "deterministic"), CHAIN_CONFIGS)
def test_chain_drafts_of_every_length_keep_the_target(gamma, top_k, top_p, deterministic):
    target, draft = random_pair_chain(1), random_pair_chain(2)
    sampling = SamplingParams(temperature=0.9, top_k=top_k, top_p=top_p, max_tokens=gamma + 3)
    run = sample_serial(PairModel(target), lambda: PairDrafter(draft, deterministic), sampling,
                        SpecConfig(method="draft", gamma=gamma), N, seed=gamma + 10 * deterministic)
    check_lengths(run, gamma, N)
    result = sequential_chi_square(run.replies, reference_rows(target, sampling))
    report(result, run, gamma)
    assert result.p > 1e-3, (result, run.rounds.summary(gamma))


# ---- negative controls: faults only at draft positions 2 and later --------------------------------
def _shift_q_rows(monkeypatch):
    # verify draft position i against the draft row of position i - 1
    real = settle.verify_sampled

    def shifted(p, q, draft, draws, position=0):
        if q is not None and len(q) > 1:
            q = torch.cat([q[:1], q[:-1]])
        return real(p, q, draft, draws, position)

    monkeypatch.setattr(settle, "verify_sampled", shifted)


def _residual_from_the_row_before(monkeypatch):
    # a rejection at draft position i >= 2 draws its residual from row i - 1's p and q
    real_verify, real_residual = rejection.verify_sampled, rejection.residual_distribution
    current = {}

    def verify(p, q, draft, draws, position=0):
        current.update(p=p, q=q)
        return real_verify(p, q, draft, draws, position)

    def residual(p_row, q_row, token):
        p = current["p"]
        i = (p_row.data_ptr() - p.data_ptr()) // (p.stride(0) * p.element_size())
        if i >= 1:
            return real_residual(p[i - 1], None if q_row is None else current["q"][i - 1], token)
        return real_residual(p_row, q_row, token)

    monkeypatch.setattr(settle, "verify_sampled", verify)
    monkeypatch.setattr(rejection, "residual_distribution", residual)


def _drop_the_bonus(monkeypatch):
    # after a whole draft is accepted the round emits the drafts alone: the cache, rolled to the
    # accepted drafts, then already holds the last emitted token
    def emitted(self, draft):
        if draft and self.accepted == len(draft):
            return list(draft)
        return draft[: self.accepted] + [self.next_token]

    monkeypatch.setattr(rejection.Verdict, "emitted", emitted)


CONTROLS = {"q-row-shifted": _shift_q_rows, "residual-wrong-row": _residual_from_the_row_before,
            "bonus-dropped": _drop_the_bonus}


@pytest.mark.parametrize("top_k", [3, 0])
@pytest.mark.parametrize("fault", list(CONTROLS))
def test_faults_at_late_draft_positions_are_caught(fault, top_k, monkeypatch):
    """With top-k 3 some faults emit tokens the target gives no mass; without it every token is
    possible and the faults are caught by the distribution alone."""
    CONTROLS[fault](monkeypatch)
    target, draft = random_pair_chain(1), random_pair_chain(2)
    gamma = 3
    sampling = SamplingParams(temperature=0.9, top_k=top_k, max_tokens=gamma + 3)
    run = sample_serial(PairModel(target), lambda: PairDrafter(draft), sampling,
                        SpecConfig(method="draft", gamma=gamma), N, seed=40 + len(fault) + top_k)
    result = sequential_chi_square(run.replies, reference_rows(target, sampling))
    report(result, run, gamma)
    assert result.p < 1e-6, (fault, result)


# ---- EAGLE: chains (with fused feature layers) and trees of depth 2 and more ------------------------
@pytest.mark.parametrize(("gamma", "top_k", "feature_layers", "tree"),
                         [(3, 3, None, 0), (5, 0, [0, 1], 0), (3, 0, None, 8), (4, 3, [0, 1], 10)],
                         ids=["chain3-topk3", "chain5-eagle3", "tree8-depth3", "tree10-depth4-eagle3"])
def test_eagle_drafts_of_every_length_keep_the_target(gamma, top_k, feature_layers, tree):
    from openalice_runner.engine.drafters.eagle import EagleDrafter

    target = random_pair_chain(1)
    runtime = random_eagle_runtime(gamma, feature_layers)
    sampling = SamplingParams(temperature=0.9, top_k=top_k, max_tokens=gamma + 3)
    run = sample_serial(PairModel(target), lambda: EagleDrafter(runtime, 128, VOCAB, tree_nodes=tree), sampling,
                        SpecConfig(method="eagle", gamma=gamma), N, seed=50 + gamma + tree)
    if tree:  # a tree's depth follows the head's confidence: deep ones many times, never beyond γ
        assert max(run.rounds.by_depth) <= gamma
        assert run.rounds.full(2) > N // 4 and run.rounds.full(gamma) > N // 20, run.rounds.by_depth  # γ: 3, 4
        assert run.rounds.accepted_at_least(2) > N // 20, run.rounds.by_depth
        assert run.rounds.late_rejections() > N // 20, run.rounds.by_depth
    else:
        check_lengths(run, gamma, N)
    result = sequential_chi_square(run.replies, reference_rows(target, sampling))
    report(result, run, gamma)
    assert result.p > 1e-3, (result, run.rounds.by_depth)


@pytest.mark.parametrize(("gamma", "top_k", "tree"), [(4, 0, 0), (3, 3, 8)], ids=["chain4", "tree8-depth3-topk3"])
def test_eagle3_layout_drafts_of_every_length_keep_the_target(gamma, top_k, tree):
    """A head in the EAGLE-3 layout (issue 47): three taps, its own LM head over a draft vocabulary
    that leaves a token out, the pre-norm output fed back; chains and trees stay exact."""
    from openalice_runner.engine.drafters.eagle import EagleDrafter

    target = random_pair_chain(1)
    runtime = random_eagle3_runtime(gamma + tree)
    sampling = SamplingParams(temperature=0.9, top_k=top_k, max_tokens=gamma + 3)
    run = sample_serial(PairModel(target), lambda: EagleDrafter(runtime, 128, VOCAB, tree_nodes=tree), sampling,
                        SpecConfig(method="eagle", gamma=gamma), N, seed=70 + gamma + tree)
    if tree:
        assert max(run.rounds.by_depth) <= gamma
        assert run.rounds.accepted_at_least(2) > N // 20, run.rounds.by_depth
    else:
        check_lengths(run, gamma, N)
    result = sequential_chi_square(run.replies, reference_rows(target, sampling))
    report(result, run, gamma)
    assert result.p > 1e-3, (result, run.rounds.by_depth)


def test_lookup_first_eagle_drafts_of_every_length_keep_the_target():
    """Prompt lookup drafts (one-hot q) where the text has a bigram match and the head (its own q)
    elsewhere, round by round, both at full length."""
    from openalice_runner.engine.drafters.eagle import EagleDrafter
    from openalice_runner.engine.drafters.lookup_first import LookupFirstDrafter
    from openalice_runner.engine.drafters.ngram import NgramDrafter

    target, gamma = random_pair_chain(1), 4
    runtime = random_eagle_runtime(gamma)
    sampling = SamplingParams(temperature=0.9, top_k=3, max_tokens=gamma + 4)
    made = []

    def make():
        made.append(LookupFirstDrafter(NgramDrafter(2, 2), EagleDrafter(runtime, 128, VOCAB)))
        return made[-1]

    run = sample_serial(PairModel(target), make, sampling, SpecConfig(method="eagle", gamma=gamma, eagle_lookup=True),
                        N, seed=90)
    rounds = {source: sum(d.rounds[source] for d in made) for source in ("lookup", "head")}
    assert min(rounds.values()) > N // 10, rounds  # both drafted, many times
    check_lengths(run, gamma, N)
    result = sequential_chi_square(run.replies, reference_rows(target, sampling))
    report(result, run, gamma)
    assert result.p > 1e-3, (result, rounds)


# ---- lookup drafters on a sampled request: n-gram and suffix ---------------------------------------
def _long_prompt(seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (40,), generator=gen).tolist() + PROMPT


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_lookup_drafts_of_every_length_keep_the_target(method):
    from openalice_runner.engine.drafters.ngram import NgramDrafter
    from openalice_runner.engine.drafters.suffix import RecentResponses, SuffixDrafter

    target, gamma = random_pair_chain(1), 4
    sampling = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=gamma + 4)
    prompt = _long_prompt(3)
    if method == "ngram":
        make = lambda: NgramDrafter(1, 2)  # noqa: E731
    else:  # one store for all the replies, seeded with text of another chain
        shared = RecentResponses(n_min=1, n_max=3)
        shared.extend(shared.open(), _long_prompt(7) * 3)
        make = lambda: SuffixDrafter(shared, 1, 2)  # noqa: E731
    # one-hot drafts are verified by the target's own draws, so on the same seeds both drafters
    # would emit plain decoding's replies: different seeds make them two checks, not one
    run = sample_serial(PairModel(target), make, sampling, SpecConfig(method=method, gamma=gamma), N,
                        seed=60 if method == "ngram" else 61, prompt=prompt)
    check_lengths(run, gamma, N)
    result = sequential_chi_square(run.replies, reference_rows(target, sampling), prompt)
    report(result, run, gamma)
    assert result.p > 1e-3, (result, run.rounds.summary(gamma))


# ---- under a grammar: masked rows and forced spans -----------------------------------------------
# Under a grammar the last WINDOW (24) tokens of slack before the budget's end are the closing
# window of engine/closing.py (where drafting once stopped): the replies run long enough for several rounds
# of full drafts before that.
MASKED_LENGTH = 34
N_MASKED = 1200


@pytest.mark.parametrize(("gamma", "top_k", "deterministic"), [(3, 0, False), (4, 3, True)],
                         ids=["gamma3-sampled", "gamma4-topk3-onehot"])
def test_masked_drafts_of_every_length_keep_the_masked_target(gamma, top_k, deterministic):
    target, draft = random_pair_chain(1), grammar_drafts(2)
    sampling = SamplingParams(temperature=0.9, top_k=top_k, max_tokens=MASKED_LENGTH)
    run = sample_serial(PairModel(target), lambda: PairDrafter(draft, deterministic), sampling,
                        SpecConfig(method="draft", gamma=gamma), N_MASKED, seed=70 + gamma, constraint=chain_constraint)
    assert run.forced > N_MASKED  # forced spans (1 -> 3 -> 2) came up, drafted for free
    check_lengths(run, gamma, N_MASKED)
    result = sequential_chi_square(run.replies, reference_rows(target, sampling, GRAMMAR_ROWS))
    report(result, run, gamma)
    assert result.p > 1e-3, (result, run.rounds.summary(gamma))


def test_masked_late_fault_is_caught(monkeypatch):
    # (a residual from the row before would be caught too, by the grammar: it leaves the mask)
    _shift_q_rows(monkeypatch)
    target, draft = random_pair_chain(1), grammar_drafts(2)
    sampling = SamplingParams(temperature=0.9, max_tokens=MASKED_LENGTH)
    run = sample_serial(PairModel(target), lambda: PairDrafter(draft), sampling, SpecConfig(method="draft", gamma=3),
                        N_MASKED, seed=79, constraint=chain_constraint)
    result = sequential_chi_square(run.replies, reference_rows(target, sampling, GRAMMAR_ROWS))
    report(result, run, 3)
    assert result.p < 1e-6


# ---- the batching engine: different prompt and reply lengths, γ and drafters in one pass ------------
def _batch_jobs(draft):
    from openalice_runner.engine.drafters.ngram import NgramDrafter

    long_prompt = _long_prompt(5)  # ends in PROMPT's two tokens, as the others
    return [
        (PROMPT, 7, SpecConfig(method="draft", gamma=5), lambda: PairDrafter(draft)),
        ([3, 0, *PROMPT], 5, SpecConfig(method="draft", gamma=3), lambda: PairDrafter(draft, True)),
        (long_prompt, 9, SpecConfig(method="ngram", gamma=4), lambda: NgramDrafter(1, 2)),
        (PROMPT, 4, SpecConfig(method="draft", gamma=2), lambda: PairDrafter(draft)),
        ([0, *PROMPT], 6, SpecConfig(method="off"), lambda: None),
    ]


def test_batched_drafts_of_every_length_keep_the_target():
    target, draft = random_pair_chain(1), random_pair_chain(2)
    sampling = SamplingParams(temperature=0.9, top_k=3)
    run = sample_batched(PairModel(target), _batch_jobs(draft), sampling, N, seed=80)
    assert run.rounds.full(5) > N // 10 and run.rounds.full(4) > N // 5, run.rounds.by_depth
    assert run.rounds.accepted_at_least(2) > N // 10 and run.rounds.late_rejections() > N // 10, run.rounds.by_depth
    assert run.rounds.full_accepts(5) > 0
    assert {len(r) for r in run.replies} == {7, 5, 9, 4, 6}
    result = sequential_chi_square(run.replies, reference_rows(target, sampling))
    report(result, run, 5)
    assert result.p > 1e-3, (result, run.rounds.by_depth)


def test_batched_late_fault_is_caught(monkeypatch):
    _drop_the_bonus(monkeypatch)
    target, draft = random_pair_chain(1), random_pair_chain(2)
    sampling = SamplingParams(temperature=0.9, top_k=3)
    run = sample_batched(PairModel(target), _batch_jobs(draft), sampling, N, seed=81)
    result = sequential_chi_square(run.replies, reference_rows(target, sampling))
    report(result, run, 5)
    assert result.p < 1e-6


# ---- the three-token tests of engine/grammar/test_sampling_exact.py, at full length ----------------------
# Each configuration those tests ran on three-token replies (drafts of one token at most), again
# with replies of γ + 3 tokens on the second-order chain. For the first three reply positions the
# sequential chi-square's groups hold the whole past (the prompt is fixed), so it tests the joint
# of the first three tokens as those tests did, and every later position besides.
JOINT_CONFIGS = [
    pytest.param(gamma, top_p, det, id=f"gamma{gamma}-topp{top_p}-{'onehot' if det else 'sampled'}")
    for gamma in (1, 3, 5) for top_p in (1.0, 0.8) for det in (False, True)
    # (3, 0.8, one-hot) and (5, 0.8, sampled) are CHAIN_CONFIGS' own (top-k off there too)
    if (gamma, top_p, det) not in {(3, 0.8, True), (5, 0.8, False)}
]


@pytest.mark.parametrize(("gamma", "top_p", "deterministic"), JOINT_CONFIGS)
def test_joint_configurations_at_full_length_keep_the_target(gamma, top_p, deterministic):
    target, draft = random_pair_chain(1), random_pair_chain(2)
    sampling = SamplingParams(temperature=0.9, top_p=top_p, max_tokens=gamma + 3)
    run = sample_serial(PairModel(target), lambda: PairDrafter(draft, deterministic), sampling,
                        SpecConfig(method="draft", gamma=gamma), N,
                        seed=200 + 10 * gamma + 2 * (top_p < 1.0) + deterministic)
    check_lengths(run, gamma, N)
    result = sequential_chi_square(run.replies, reference_rows(target, sampling))
    report(result, run, gamma)
    assert result.p > 1e-3, (result, run.rounds.summary(gamma))


def test_residual_from_p_is_caught_at_full_length(monkeypatch):
    # a classic bug: after a rejection, resample from p instead of norm(max(0, p - q))
    monkeypatch.setattr(rejection, "residual_distribution", lambda p, q, token: p)
    target, draft = random_pair_chain(1), random_pair_chain(2)
    sampling = SamplingParams(temperature=0.9, max_tokens=6)
    run = sample_serial(PairModel(target), lambda: PairDrafter(draft), sampling, SpecConfig(method="draft", gamma=3),
                        N, seed=207)
    check_lengths(run, 3, N)
    result = sequential_chi_square(run.replies, reference_rows(target, sampling))
    report(result, run, 3)
    assert result.p < 1e-6, result


def test_accepting_everything_is_caught_at_full_length(monkeypatch):
    # accept every draft token (the output would follow q, not p)
    from openalice_runner.engine.sampling import TokenDraws, stream

    real = settle.verify_sampled

    def accept_all(p, q, draft, draws, position=0):
        real(p, q, draft, draws, position)  # keep the random streams' use alike
        bonus = stream(draws, position + len(draft), TokenDraws.TARGET)
        return rejection.Verdict(len(draft), int(torch.multinomial(p[len(draft)], 1, generator=bonus)))

    monkeypatch.setattr(settle, "verify_sampled", accept_all)
    target, draft = random_pair_chain(1), random_pair_chain(2)
    sampling = SamplingParams(temperature=0.9, max_tokens=6)
    run = sample_serial(PairModel(target), lambda: PairDrafter(draft), sampling, SpecConfig(method="draft", gamma=3),
                        N, seed=208)
    assert run.rounds.full_accepts(3) > N // 4, run.rounds.summary(3)  # whole drafts of γ, all kept
    result = sequential_chi_square(run.replies, reference_rows(target, sampling))
    report(result, run, 3)
    assert result.p < 1e-6, result


# EAGLE as the three-token test ran it: chains with top-p, fused feature layers, drafts sized by the
# head's own confidence (unseeded), lookup-first with a unigram lookup, trees, and their mixtures.
# `full`: the least share of N rounds that must reach γ (confidence-sized drafts and small trees
# reach it less often than a fixed chain).
EAGLE_CONFIGS = [
    pytest.param(*c, id=i) for c, i in [
        ((3, 1.0, None, 0.0, False, 0, 4), "chain3"),
        ((5, 0.8, None, 0.0, False, 0, 4), "chain5-topp0.8"),
        ((4, 0.9, [0, 1], 0.0, False, 0, 4), "chain4-topp0.9-eagle3"),
        ((6, 1.0, None, 0.02, False, 0, 20), "chain6-sized"),
        ((4, 1.0, None, 0.0, True, 0, 4), "chain4-lookup"),
        ((4, 1.0, None, 0.0, False, 6, 20), "tree6-depth4"),
        ((5, 0.9, [0, 1], 0.1, False, 8, 20), "tree8-depth5-sized-eagle3"),
        ((4, 1.0, None, 0.0, True, 5, 20), "tree5-depth4-lookup"),
    ]
]


def _fixed_step_time(monkeypatch, runtime) -> None:
    """Confidence-sized drafts weigh a head step's measured time: a fixed one keeps the lengths
    (and the assertions on them) independent of the machine's speed and load."""
    from openalice_runner.engine.drafters import eagle

    runtime.draft_step_s = 1e-4
    monkeypatch.setattr(eagle, "_record_step", lambda rt, seconds: None)


def _unseeded(monkeypatch, seed: int) -> None:
    # A seeded request drafts a fixed γ (its output must not hang on timing), so confidence-sized
    # drafts run unseeded: each request's fresh seed comes from a seeded source, not the OS.
    import random

    from openalice_runner.engine import sampling as sampling_module

    monkeypatch.setattr(sampling_module.secrets, "randbits", random.Random(seed).getrandbits)


def _sample_unseeded(model, make_drafter, sampling: SamplingParams, spec, n: int) -> Run:
    """sample_serial's loop with seed None (the seeds come from the patched source)."""
    from stand_ins.pair_chain import PairCache, SilentTokenizer

    from openalice_runner.engine.generator import run_sequence
    from openalice_runner.engine.sequence import SequenceRequest, Target, new_sequence

    run = Run([], Rounds.empty())
    for _ in range(n):
        s = SamplingParams(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
                           max_tokens=sampling.max_tokens)
        seq = new_sequence(SequenceRequest(PROMPT, s, spec, make_drafter()),
                           Target(PairCache(), SilentTokenizer(), frozenset(), context_length=128))
        result = None
        for event in run_sequence(model, seq):
            result = event.result or result
        run.replies.append(tuple(result.token_ids))
        run.rounds.add(result.stats.draft_depth_histogram)
        run.proposed += result.stats.proposed
    return run


@pytest.mark.parametrize(("gamma", "top_p", "feature_layers", "costs", "lookup", "tree", "full"), EAGLE_CONFIGS)
def test_eagle_configurations_at_full_length_keep_the_target(gamma, top_p, feature_layers, costs, lookup, tree,
                                                             full, monkeypatch):
    """With `costs` (what each verify row adds to a pass's time, as a share of it) the head
    sizes each draft from its own confidence, so lengths vary round to round: the three-token
    test's tenth for the tree; a fiftieth for the chain of 6 (at a tenth this head never found a
    sixth token worth its row, and at a fiftieth the tree grows wide, never past depth 3); with `lookup` prompt lookup (a unigram
    match, one-hot q) drafts where the text has a match and the head elsewhere; with `tree` the
    head drafts trees of up to that many nodes and depth γ."""
    from openalice_runner.engine.cost_model import PassCostModel
    from openalice_runner.engine.drafters.eagle import EagleDrafter
    from openalice_runner.engine.drafters.lookup_first import LookupFirstDrafter
    from openalice_runner.engine.drafters.ngram import NgramDrafter

    target = random_pair_chain(1)
    runtime = random_eagle_runtime(gamma, feature_layers)
    pass_costs = None
    if costs:
        pass_costs = PassCostModel()
        for rows in range(1, 8):
            pass_costs.record(rows, 0.01 * (1 + costs * (rows - 1)))
        _fixed_step_time(monkeypatch, runtime)
        _unseeded(monkeypatch, 300 + gamma)
    heads, made = [], []

    def make():
        heads.append(EagleDrafter(runtime, 128, VOCAB, costs=pass_costs, tree_nodes=tree))
        made.append(LookupFirstDrafter(NgramDrafter(1, 1), heads[-1]) if lookup else heads[-1])
        return made[-1]

    sampling = SamplingParams(temperature=0.9, top_p=top_p, max_tokens=gamma + 3)
    spec = SpecConfig(method="eagle", gamma=gamma)
    if costs:
        run = _sample_unseeded(PairModel(target), make, sampling, spec, N)
    else:
        run = sample_serial(PairModel(target), make, sampling, spec, N, seed=310 + gamma + tree + 50 * lookup)
    r, summary = run.rounds, run.rounds.summary(gamma)
    assert run.proposed >= (N // 2 if costs else N)  # the head drafted
    assert max(r.by_depth) <= gamma, r.by_depth
    assert r.full(gamma) > N // full, summary
    assert r.accepted_at_least(2) > N // 20 and r.late_rejections() > N // 20, summary
    if not tree:
        assert r.full_accepts(gamma) > 0, summary
    if costs:  # lengths really varied, by confidence: drafts of every depth from 1 to γ
        assert all(r.full(d) > r.full(d + 1) for d in range(1, gamma)), r.by_depth
    if tree and not costs:
        assert run.proposed > 2 * N  # trees: several candidates a round
    if lookup:  # both drafted, many times
        rounds = {source: sum(d.rounds[source] for d in made) for source in ("lookup", "head")}
        assert min(rounds.values()) > N // 4, rounds
    assert heads[-1].feats.shape[1] == (len(feature_layers or ()) + 1) * HIDDEN  # it read the taps
    result = sequential_chi_square(run.replies, reference_rows(target, sampling))
    report(result, run, gamma)
    assert result.p > 1e-3, (result, r.by_depth)


def test_broken_tree_sampler_is_caught_at_full_length(monkeypatch):
    """Tree verification that tries each sibling against the target's p instead of the residual
    left by the siblings rejected before it, on trees reaching depth 3."""
    from openalice_runner.engine import tree
    from openalice_runner.engine.drafters.eagle import EagleDrafter
    from openalice_runner.engine.sampling import TokenDraws, stream

    def broken(p, tokens, parents, draws, position=0):
        gen = stream(draws, position, TokenDraws.TARGET)
        kids = tree.children(parents)
        path, row = [], 0
        while True:
            accepted = next((c for c in kids[row] if float(torch.rand((), generator=gen)) < float(p[row, tokens[c]])),
                            None)
            if accepted is None:
                residual = p[row].clone()
                residual[[tokens[c] for c in kids[row]]] = 0.0
                residual = residual if residual.sum() > 0 else p[row]
                return tree.TreeVerdict(path, int(torch.multinomial(residual, 1, generator=gen)))
            path.append(accepted)
            row = accepted + 1

    monkeypatch.setattr(settle, "verify_tree_sampled", broken)
    target, runtime = random_pair_chain(1), random_eagle_runtime(4)
    sampling = SamplingParams(temperature=0.9, max_tokens=6)
    run = sample_serial(PairModel(target), lambda: EagleDrafter(runtime, 128, VOCAB, tree_nodes=6), sampling,
                        SpecConfig(method="eagle", gamma=3), N, seed=330)
    r = run.rounds
    assert r.full(3) > N // 20 and r.accepted_at_least(2) > N // 20 and r.late_rejections() > N // 20, r.by_depth
    result = sequential_chi_square(run.replies, reference_rows(target, sampling))
    report(result, run, 3)
    assert result.p < 1e-6, result


@pytest.mark.parametrize("gamma", [2, 5])
def test_suffix_configurations_at_full_length_keep_the_target(gamma):
    """The suffix drafter's drafts come from other requests' outputs (one store shared by all the
    replies, seeded with 200 random tokens) and from the reply's own tokens, top-p 0.8. The store
    keeps the latest 64 replies: replies of 16 tokens leave continuations long enough for γ 5
    (at γ + 3 tokens 19 rounds of 2500 replies drafted 5)."""
    from openalice_runner.engine.drafters.suffix import RecentResponses, SuffixDrafter

    target = random_pair_chain(1)
    sampling = SamplingParams(temperature=0.9, top_p=0.8, max_tokens=16)
    shared = RecentResponses(n_min=1, n_max=3)
    gen = torch.Generator().manual_seed(7)
    shared.extend(shared.open(), torch.randint(0, VOCAB, (200,), generator=gen).tolist())
    run = sample_serial(PairModel(target), lambda: SuffixDrafter(shared, 1, 2), sampling,
                        SpecConfig(method="suffix", gamma=gamma), N, seed=340 + gamma)
    check_lengths(run, gamma, N)
    result = sequential_chi_square(run.replies, reference_rows(target, sampling))
    report(result, run, gamma)
    assert result.p > 1e-3, (result, run.rounds.summary(gamma))
