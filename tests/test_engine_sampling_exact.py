"""Sequence-level exactness of speculative sampling on a small random Markov "model".

The decode loop runs unchanged (prefill, rounds, rollback); only the model is a first-order
Markov chain, so the exact joint distribution of the first three tokens is known in closed
form. A chi-square test compares it with many sampled sequences, for γ in {1, 3, 5}, with
top-p on and off, for a sampled drafter (with its own q) and a deterministic one (one-hot q);
and the same test must fail when the sampler is deliberately broken.
"""

from __future__ import annotations

import random

import pytest
import torch
from stand_ins.markov import (
    LENGTH,
    PROMPT,
    VOCAB,
    MarkovDrafter,
    MarkovModel,
    SilentTokenizer,
    ToyCache,
    chi_square_p,
    exact_joint,
    random_chain,
    sample_sequences,
)
from stand_ins.pair_chain import (
    GRAMMAR_ROWS,
    PairDrafter,
    PairModel,
    chain_constraint,
    grammar_drafts,
    random_pair_chain,
    reference_rows,
    sample_serial,
    sequential_chi_square,
)

from openalice_runner.engine import rejection
from openalice_runner.engine.generator import new_sequence, run_sequence
from openalice_runner.engine.sampling import TokenDraws, stream
from openalice_runner.engine.types import SamplingParams, SpecConfig

N = 2500


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny tensors: torch's intra-op threads only wait on each other (14x slower on a loaded
    2-core machine); the old setting comes back after each test."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


CONFIGS = [
    pytest.param(gamma, top_p, deterministic, id=f"gamma{gamma}-topp{top_p}-{'onehot' if deterministic else 'sampled'}")
    for gamma in (1, 3, 5)
    for top_p in (1.0, 0.8)
    for deterministic in (False, True)
]


@pytest.mark.parametrize(("gamma", "top_p", "deterministic"), CONFIGS)
def test_speculative_sampling_matches_exact_joint(gamma, top_p, deterministic):
    target, draft = random_chain(1), random_chain(2)
    sampling = SamplingParams(temperature=0.9, top_p=top_p, max_tokens=LENGTH)
    joint = exact_joint(target, sampling)
    counts = sample_sequences(target, MarkovDrafter(draft, deterministic), sampling, gamma, N, seed=gamma)
    assert chi_square_p(joint, counts, N) > 1e-3


def test_broken_sampler_is_caught(monkeypatch):
    # A classic bug: after a rejection, resample from p instead of norm(max(0, p - q)).
    monkeypatch.setattr(rejection, "residual_distribution", lambda p, q, token: p)
    target, draft = random_chain(1), random_chain(2)
    sampling = SamplingParams(temperature=0.9, max_tokens=LENGTH)
    joint = exact_joint(target, sampling)
    counts = sample_sequences(target, MarkovDrafter(draft, deterministic=False), sampling, 3, N, seed=7)
    assert chi_square_p(joint, counts, N) < 1e-6


def test_accepting_everything_is_caught(monkeypatch):
    # Another broken sampler: accept every draft token (the output would follow q, not p).
    real = rejection.verify_sampled

    def accept_all(p, q, draft, draws, position=0):
        real(p, q, draft, draws, position)  # keep the random streams' use alike
        bonus = stream(draws, position + len(draft), TokenDraws.TARGET)
        return rejection.Verdict(len(draft), int(torch.multinomial(p[len(draft)], 1, generator=bonus)))

    monkeypatch.setattr("openalice_runner.engine.generator.verify_sampled", accept_all)
    target, draft = random_chain(1), random_chain(2)
    sampling = SamplingParams(temperature=0.9, max_tokens=LENGTH)
    joint = exact_joint(target, sampling)
    counts = sample_sequences(target, MarkovDrafter(draft, deterministic=False), sampling, 3, N, seed=8)
    assert chi_square_p(joint, counts, N) < 1e-6


# ---- the EAGLE drafter: a random head over the chain's one-hot "hidden states" -----------------
class FeatureMarkovModel(MarkovModel):
    """The same chain, but its hidden states are one-hot feature rows (what an EAGLE head reads)."""

    HIDDEN = 16

    def forward(self, tokens, cache, slots, taps=(), tree=None):
        # a first-order chain: a tree node's next-token distribution depends on its token alone
        cache.lengths[slots[0]] += tokens.shape[1]
        hidden = torch.nn.functional.one_hot(tokens, self.HIDDEN).float()
        if not taps:
            return hidden
        # stand-ins for earlier layers' residual streams: the same rows, scaled per layer
        return hidden, torch.cat([hidden * (2.0 + i) for i in taps], dim=-1)

    def logits(self, hidden):
        return self.log_table[hidden[..., :VOCAB].argmax(-1)]


def random_eagle_runtime(seed: int, feature_layers: list[int] | None = None):
    from types import SimpleNamespace

    from openalice_runner.engine.eagle.head import EagleHead, EagleRuntime, HeadConfig

    torch.manual_seed(seed)
    h = FeatureMarkovModel.HIDDEN
    cfg = HeadConfig(hidden=h, n_heads=2, n_kv_heads=1, head_dim=8, intermediate=32, eps=1e-5, rope_theta=10000.0,
                     max_positions=64, target={}, draft_vocab=[3, 1, 0, 2], feature_layers=feature_layers)
    head = EagleHead(cfg)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0.0, 0.5)
    target = SimpleNamespace(weight_dtype=torch.float32, embed=torch.randn(VOCAB, h),
                             lm_head=SimpleNamespace(weight=torch.randn(VOCAB, h)))
    return EagleRuntime(head, target)


@pytest.mark.parametrize(("gamma", "top_p", "feature_layers", "costs", "lookup", "tree"),
                         [(3, 1.0, None, False, False, 0), (5, 0.8, None, False, False, 0),
                          (4, 0.9, [0, 1], False, False, 0), (6, 1.0, None, True, False, 0),
                          (4, 1.0, None, False, True, 0), (4, 1.0, None, False, False, 6),
                          (5, 0.9, [0, 1], True, False, 8), (4, 1.0, None, False, True, 5)])
def test_speculative_sampling_exact_with_eagle_drafter(gamma, top_p, feature_layers, costs, lookup, tree,
                                                      monkeypatch):
    """With `feature_layers`, an EAGLE-3-style head that fuses tapped layers with f_t. With
    `costs`, the drafter sizes each draft from its own confidence (lengths vary round to round).
    With `lookup`, prompt lookup drafts (one-hot q) where the text has a match and the head
    (its own q) elsewhere, round by round. With `tree`, the head drafts trees of up to that many
    tokens (its top candidates, one-hot q), verified by the multi-candidate rule."""
    from openalice_runner.engine.cost_model import PassCostModel
    from openalice_runner.engine.drafters.eagle import EagleDrafter
    from openalice_runner.engine.drafters.lookup_first import LookupFirstDrafter
    from openalice_runner.engine.drafters.ngram import NgramDrafter

    pass_costs = None
    if costs:  # every verify row costs a tenth of a pass: only confident drafts run long
        pass_costs = PassCostModel()
        for rows in range(1, 8):
            pass_costs.record(rows, 0.01 * (1 + 0.1 * (rows - 1)))
    lengths: set[int] = set()
    rounds = {"lookup": 0, "head": 0}
    if costs:
        # A seeded request drafts a fixed γ (its output must not hang on timing), so the
        # confidence-sized drafts run unseeded: each request's fresh seed comes from a seeded
        # source instead of the OS, to keep the run reproducible.
        from openalice_runner.engine import sampling as sampling_module

        fresh = random.Random(gamma)
        monkeypatch.setattr(sampling_module.secrets, "randbits", fresh.getrandbits)

    target = random_chain(1)
    runtime = random_eagle_runtime(gamma, feature_layers)
    sampling = SamplingParams(temperature=0.9, top_p=top_p, max_tokens=LENGTH)
    joint = exact_joint(target, sampling)
    model = FeatureMarkovModel(target)
    counts: dict[tuple[int, ...], int] = {}
    proposed = 0
    for i in range(N):
        seed = None if costs else gamma * 100_000 + i
        s = SamplingParams(temperature=0.9, top_p=top_p, seed=seed, max_tokens=LENGTH)
        drafter = head = EagleDrafter(runtime, 64, VOCAB, costs=pass_costs, tree_nodes=tree)
        if lookup:  # a repeated last token matches (lookup drafts), a new one does not (the head does)
            drafter = LookupFirstDrafter(NgramDrafter(1, 1), head)
        seq = new_sequence(PROMPT, s, SpecConfig(method="eagle", gamma=gamma), drafter, ToyCache(),
                           SilentTokenizer(), frozenset(), context_length=64)
        result = None
        for event in run_sequence(model, seq):
            result = event.result or result
        proposed += result.stats.draft_proposed
        lengths.add(result.stats.draft_proposed)
        if lookup:
            for source, n in drafter.rounds.items():
                rounds[source] += n
        key = tuple(result.token_ids)
        counts[key] = counts.get(key, 0) + 1
    assert proposed >= (N // 2 if costs else N)  # fixed γ: the head drafted in every sequence
    if tree and not costs:
        assert proposed > 2 * N  # trees: several candidates a round
    if costs and not tree:
        assert len(lengths) > 1  # draft lengths really varied
    if lookup:  # both drafted, many times
        assert min(rounds.values()) > N // 4, rounds
    assert head.feats.shape[1] == (len(feature_layers or ()) + 1) * FeatureMarkovModel.HIDDEN  # it read the taps
    assert chi_square_p(joint, counts, N) > 1e-3


def test_broken_tree_sampler_is_caught(monkeypatch):
    """The same check fails where tree verification tries each sibling against the target's p
    instead of the residual left by the siblings rejected before it."""
    from openalice_runner.engine import generator, tree
    from openalice_runner.engine.drafters.eagle import EagleDrafter

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

    monkeypatch.setattr(generator, "verify_tree_sampled", broken)
    target = random_chain(1)
    runtime = random_eagle_runtime(4)
    sampling = SamplingParams(temperature=0.9, max_tokens=LENGTH)
    joint = exact_joint(target, sampling)
    model = FeatureMarkovModel(target)
    counts: dict[tuple[int, ...], int] = {}
    for i in range(N):
        s = SamplingParams(temperature=0.9, seed=900_000 + i, max_tokens=LENGTH)
        seq = new_sequence(PROMPT, s, SpecConfig(method="eagle", gamma=3), EagleDrafter(runtime, 64, VOCAB, tree_nodes=6),
                           ToyCache(), SilentTokenizer(), frozenset(), context_length=64)
        result = None
        for event in run_sequence(model, seq):
            result = event.result or result
        key = tuple(result.token_ids)
        counts[key] = counts.get(key, 0) + 1
    assert chi_square_p(joint, counts, N) < 1e-6


@pytest.mark.parametrize("gamma", [2, 5])
def test_speculative_sampling_exact_with_suffix_drafter(gamma):
    """The suffix drafter's drafts come from other requests' outputs (one store shared by all the
    sampled sequences, seeded with text of another chain) and from the sequence's own tokens."""
    from openalice_runner.engine.drafters.suffix import RecentResponses, SuffixDrafter

    target = random_chain(1)
    sampling = SamplingParams(temperature=0.9, top_p=0.8, max_tokens=LENGTH)
    joint = exact_joint(target, sampling)
    shared = RecentResponses(n_min=1, n_max=3)
    seed_text = shared.open()
    gen = torch.Generator().manual_seed(7)
    shared.extend(seed_text, torch.randint(0, VOCAB, (200,), generator=gen).tolist())
    model = MarkovModel(target)
    counts: dict[tuple[int, ...], int] = {}
    proposed = 0
    for i in range(N):
        s = SamplingParams(temperature=0.9, top_p=0.8, seed=gamma * 100_000 + i, max_tokens=LENGTH)
        seq = new_sequence(PROMPT, s, SpecConfig(method="suffix", gamma=gamma), SuffixDrafter(shared, 1, 2),
                           ToyCache(), SilentTokenizer(), frozenset(), context_length=64)
        result = None
        for event in run_sequence(model, seq):
            result = event.result or result
        proposed += result.stats.draft_proposed
        counts[tuple(result.token_ids)] = counts.get(tuple(result.token_ids), 0) + 1
    assert proposed > N // 3  # it drafted (about 0.6 a sequence: 3 tokens leave room for few drafts)
    assert chi_square_p(joint, counts, N) > 1e-3


# ---- under a grammar: the masked chain ----------------------------------------------------------
# The grammar is an automaton over the chain's tokens whose state is the last token: after 1
# only 3 is allowed and after 3 only 2 (a forced span of two tokens, drafted for free), the
# other states allow three tokens (stand_ins/pair_chain.py). Three-token replies cannot show
# drafts past the first token, and the last WINDOW (24) tokens before a constrained reply's budget
# runs out are engine/closing.py's window: these tests run on the
# second-order chain of stand_ins/pair_chain.py with replies of MASKED_LENGTH tokens, against its
# plain reference rows masked by the grammar (the sequential chi-square; docs/testing.md).
MASKED_LENGTH = 34
N_MASKED = 1200


def masked_p(target, run, sampling) -> float:
    return sequential_chi_square(run.replies, reference_rows(target, sampling, GRAMMAR_ROWS)).p


MASKED_CONFIGS = [
    pytest.param(gamma, top_p, drafter, forced, id=f"gamma{gamma}-topp{top_p}-{drafter}-{'forced' if forced else 'unforced'}")
    for gamma, top_p, drafter, forced in [
        (1, 1.0, "sampled", True), (3, 0.8, "sampled", True), (5, 1.0, "onehot", True),
        (3, 1.0, "sampled", False), (3, 0.8, "onehot", False), (3, 0.9, "none", True),
    ]
]


@pytest.mark.parametrize(("gamma", "top_p", "drafter", "forced"), MASKED_CONFIGS)
def test_constrained_speculative_sampling_matches_masked_joint(gamma, top_p, drafter, forced):
    """Output follows the *constrained* target exactly: masked p, drafts cut at the first
    forbidden token, q masked alike, forced tokens drafted for free (or not)."""
    # drafts mostly within the grammar (a tenth of the weight on forbidden tokens), so they run long
    target, draft = random_pair_chain(1), grammar_drafts(2)
    sampling = SamplingParams(temperature=0.9, top_p=top_p, max_tokens=MASKED_LENGTH)
    if drafter == "none":
        spec, make = SpecConfig(method="off", forced_drafts=forced), lambda: None
    else:
        spec = SpecConfig(method="draft", gamma=gamma, forced_drafts=forced)
        make = lambda: PairDrafter(draft, deterministic=drafter == "onehot")  # noqa: E731
    run = sample_serial(PairModel(target), make, sampling, spec, N_MASKED, seed=gamma + 10 * forced,
                        constraint=chain_constraint)
    assert (run.forced > N_MASKED // 4) == forced  # forced spans come up often, and are drafted only when asked
    assert drafter == "none" or run.proposed > N_MASKED // 10  # and the drafter drafted
    if drafter != "none":  # drafts of full length, accepted and rejected late (γ 1: full length only)
        assert run.rounds.full(gamma) > N_MASKED // 4, run.rounds.summary(gamma)
        if gamma >= 2:
            assert run.rounds.accepted_at_least(2) > N_MASKED // 20, run.rounds.summary(gamma)
            assert run.rounds.late_rejections() > N_MASKED // 20, run.rounds.summary(gamma)
    assert masked_p(target, run, sampling) > 1e-3


def test_unmasked_draft_distribution_is_caught(monkeypatch):
    # A broken constrained sampler: verify against the drafter's raw q (mass on forbidden tokens
    # included) instead of q masked and renormalised: accept and residual are both off.
    monkeypatch.setattr("openalice_runner.engine.generator.masked_probs", lambda q, allowed: q)
    target, draft = random_pair_chain(1), random_pair_chain(2)
    sampling = SamplingParams(temperature=0.9, max_tokens=MASKED_LENGTH)
    run = sample_serial(PairModel(target), lambda: PairDrafter(draft), sampling, SpecConfig(method="draft", gamma=3),
                        2 * N_MASKED, 11, constraint=chain_constraint)
    assert masked_p(target, run, sampling) < 1e-6


def test_broken_residual_under_grammar_is_caught(monkeypatch):
    monkeypatch.setattr(rejection, "residual_distribution", lambda p, q, token: p)
    target, draft = random_pair_chain(1), random_pair_chain(2)
    sampling = SamplingParams(temperature=0.9, max_tokens=MASKED_LENGTH)
    run = sample_serial(PairModel(target), lambda: PairDrafter(draft), sampling, SpecConfig(method="draft", gamma=3),
                        N_MASKED, 12, constraint=chain_constraint)
    assert masked_p(target, run, sampling) < 1e-6


# ---- forced tokens after a draft ----------------------------------------------------------------
# A draft that ends in 1 carries the span the grammar forces after it (3, then 2) and still gets
# a bonus token after the span, whose mask is the span's end state's (replies of MASKED_LENGTH).


def _counting_spans(monkeypatch, break_masks: bool = False) -> list[int]:
    """Counts the rounds whose draft carried forced tokens after it; `break_masks`: a broken
    sampler that takes the position after the span as forced too (its first allowed token)."""
    from openalice_runner.engine.grammar import GrammarConstraint

    walk_on, spans = GrammarConstraint.walk_on, []

    def counted(self, draft, then_forced):
        n, masks, after = walk_on(self, draft, then_forced)
        if after:
            spans.append(len(after))
            if break_masks:
                masks = masks.clone()
                first = int(masks[-1].nonzero()[0, 0])
                masks[-1] = False
                masks[-1, first] = True
        return n, masks, after

    monkeypatch.setattr(GrammarConstraint, "walk_on", counted)
    return spans


def test_forced_span_after_a_draft_keeps_the_masked_joint(monkeypatch):
    target, draft = random_pair_chain(1), random_pair_chain(2)
    sampling = SamplingParams(temperature=0.9, max_tokens=MASKED_LENGTH)
    spans = _counting_spans(monkeypatch)
    run = sample_serial(PairModel(target), lambda: PairDrafter(draft), sampling, SpecConfig(method="draft", gamma=1),
                        N_MASKED, 21, constraint=chain_constraint)
    assert len(spans) > N_MASKED // 10  # drafts reached the span often
    assert masked_p(target, run, sampling) > 1e-3


def test_a_span_sampler_that_forces_the_bonus_is_caught(monkeypatch):
    target, draft = random_pair_chain(1), random_pair_chain(2)
    sampling = SamplingParams(temperature=0.9, max_tokens=MASKED_LENGTH)
    spans = _counting_spans(monkeypatch, break_masks=True)
    run = sample_serial(PairModel(target), lambda: PairDrafter(draft), sampling, SpecConfig(method="draft", gamma=1),
                        N_MASKED, 22, constraint=chain_constraint)
    assert spans and masked_p(target, run, sampling) < 1e-6
