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

from openalice_runner.engine import rejection
from openalice_runner.engine.generator import new_sequence, run_sequence
from openalice_runner.engine.sampling import TokenDraws, stream
from openalice_runner.engine.types import SamplingParams, SpecConfig

N = 2500
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
# other states allow two or three tokens. The exact joint is the chain's, masked and renormalised
# row by row; GrammarConstraint runs unchanged over this automaton (its mask is the table's row).
GRAMMAR_ROWS = torch.tensor([[False, True, True, True],
                             [False, False, False, True],
                             [True, True, False, True],
                             [False, False, True, False]])


class ChainGrammar:
    """The LLMatcher methods GrammarConstraint calls, for the automaton above."""

    def __init__(self, start: int):
        self.states = [start]
        self.error = ""

    def is_stopped(self):
        return False

    def is_accepting(self):
        return True

    def is_error(self):
        return bool(self.error)

    def get_error(self):
        return self.error

    def compute_ff_tokens(self):
        out, state = [], self.states[-1]
        while len(out) < 8 and int(GRAMMAR_ROWS[state].sum()) == 1:
            state = int(GRAMMAR_ROWS[state].nonzero()[0, 0])
            out.append(state)
        return out

    def consume_token(self, token):
        if not GRAMMAR_ROWS[self.states[-1], token]:
            self.error = f"token {token} is not allowed after {self.states[-1]}"
            return False
        self.states.append(token)
        return True

    def consume_tokens(self, tokens):
        return all(self.consume_token(t) for t in tokens)

    def rollback(self, n):
        del self.states[len(self.states) - n :]
        return True


def chain_constraint():
    from types import SimpleNamespace

    from openalice_runner.engine.grammar import GrammarConstraint

    class ChainConstraint(GrammarConstraint):
        def _grammar_mask(self):
            return GRAMMAR_ROWS[self._matcher.states[-1]].clone()

    return ChainConstraint(ChainGrammar(PROMPT[-1]), SimpleNamespace(vocab_size=VOCAB, eos_ids=()))


def exact_masked_joint(table: torch.Tensor, sampling: SamplingParams, length: int = LENGTH) -> dict[tuple[int, ...], float]:
    return exact_joint(table, sampling, GRAMMAR_ROWS, length)


def sample_constrained(target, make_drafter, sampling, spec, n, seed, length=LENGTH):
    model = MarkovModel(target)
    counts: dict[tuple[int, ...], int] = {}
    forced = proposed = 0
    for i in range(n):
        s = SamplingParams(temperature=sampling.temperature, top_p=sampling.top_p, seed=seed * 100_000 + i,
                           max_tokens=length)
        seq = new_sequence(PROMPT, s, spec, make_drafter(), ToyCache(), SilentTokenizer(), frozenset(),
                           context_length=64, constraint=chain_constraint())
        result = None
        for event in run_sequence(model, seq):
            result = event.result or result
        forced += result.stats.forced_tokens
        proposed += result.stats.draft_proposed
        key = tuple(result.token_ids)
        counts[key] = counts.get(key, 0) + 1
    return counts, forced, proposed


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
    target, draft = random_chain(1), random_chain(2)
    sampling = SamplingParams(temperature=0.9, top_p=top_p, max_tokens=LENGTH)
    joint = exact_masked_joint(target, sampling)
    if drafter == "none":
        spec, make = SpecConfig(method="off", forced_drafts=forced), lambda: None
    else:
        spec = SpecConfig(method="draft", gamma=gamma, forced_drafts=forced)
        make = lambda: MarkovDrafter(draft, deterministic=drafter == "onehot")  # noqa: E731
    counts, n_forced, proposed = sample_constrained(target, make, sampling, spec, N, seed=gamma + 10 * forced)
    assert (n_forced > N // 4) == forced  # forced spans come up often, and are drafted only when asked
    assert drafter == "none" or proposed > N // 10  # and the drafter drafted
    assert chi_square_p(joint, counts, N) > 1e-3


def test_unmasked_draft_distribution_is_caught(monkeypatch):
    # A broken constrained sampler: verify against the drafter's raw q (mass on forbidden tokens
    # included) instead of q masked and renormalised: accept and residual are both off.
    monkeypatch.setattr("openalice_runner.engine.generator.masked_probs", lambda q, allowed: q)
    target, draft = random_chain(1), random_chain(2)
    sampling = SamplingParams(temperature=0.9, max_tokens=LENGTH)
    joint = exact_masked_joint(target, sampling)
    spec = SpecConfig(method="draft", gamma=3)
    counts, _, _ = sample_constrained(target, lambda: MarkovDrafter(draft, deterministic=False), sampling, spec, N, 11)
    assert chi_square_p(joint, counts, N) < 1e-6


def test_broken_residual_under_grammar_is_caught(monkeypatch):
    monkeypatch.setattr(rejection, "residual_distribution", lambda p, q, token: p)
    target, draft = random_chain(1), random_chain(2)
    sampling = SamplingParams(temperature=0.9, max_tokens=LENGTH)
    joint = exact_masked_joint(target, sampling)
    spec = SpecConfig(method="draft", gamma=3)
    counts, _, _ = sample_constrained(target, lambda: MarkovDrafter(draft, deterministic=False), sampling, spec, N, 12)
    assert chi_square_p(joint, counts, N) < 1e-6


# ---- forced tokens after a draft ----------------------------------------------------------------
# Five tokens leave room for a draft that ends in 1 to carry the span the grammar forces after it
# (3, then 2) and still get a bonus token after the span, whose mask is the span's end state's.
SPAN_LENGTH = 5


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
    target, draft = random_chain(1), random_chain(2)
    sampling = SamplingParams(temperature=0.9, max_tokens=SPAN_LENGTH)
    joint = exact_masked_joint(target, sampling, SPAN_LENGTH)
    spans = _counting_spans(monkeypatch)
    spec = SpecConfig(method="draft", gamma=1)
    counts, _, _ = sample_constrained(target, lambda: MarkovDrafter(draft, deterministic=False), sampling, spec, N,
                                      seed=21, length=SPAN_LENGTH)
    assert len(spans) > N // 10  # drafts reached the span often
    assert chi_square_p(joint, counts, N) > 1e-3


def test_a_span_sampler_that_forces_the_bonus_is_caught(monkeypatch):
    target, draft = random_chain(1), random_chain(2)
    sampling = SamplingParams(temperature=0.9, max_tokens=SPAN_LENGTH)
    joint = exact_masked_joint(target, sampling, SPAN_LENGTH)
    spans = _counting_spans(monkeypatch, break_masks=True)
    spec = SpecConfig(method="draft", gamma=1)
    counts, _, _ = sample_constrained(target, lambda: MarkovDrafter(draft, deterministic=False), sampling, spec, N,
                                      seed=22, length=SPAN_LENGTH)
    assert spans and chi_square_p(joint, counts, N) < 1e-6
