"""Sampling exactness under a grammar: the masked chain, its forced spans and their controls.

The three-token tests this file held (the chain for γ in {1, 3, 5} with top-p on and off, sampled
and one-hot drafts; the residual drawn from p and the accept-everything controls; EAGLE chains,
fused feature layers, confidence-sized drafts, lookup-first and trees; the broken tree sampler;
the suffix drafter) drafted one token at most. Each of their configurations runs at full draft
length in tests/engine/test_exact_lengths.py, with everything these checked and the draft-depth
assertions besides:
- the chain grid: `test_joint_configurations_at_full_length_keep_the_target` (10 of the 12) and
  `test_chain_drafts_of_every_length_keep_the_target` (γ 3 top-p 0.8 one-hot, γ 5 top-p 0.8 sampled);
- the controls: `test_residual_from_p_is_caught_at_full_length`,
  `test_accepting_everything_is_caught_at_full_length`, `test_broken_tree_sampler_is_caught_at_full_length`;
- EAGLE: `test_eagle_configurations_at_full_length_keep_the_target` (all eight);
- suffix: `test_suffix_configurations_at_full_length_keep_the_target` (γ 2 and 5).
For the first three reply positions the sequential chi-square's groups hold the whole past, so it
tests those replies' three-token joint too, against the plain reference instead of the engine's
own processed_probs.
"""

from __future__ import annotations

import pytest
from stand_ins.pair_chain import (
    GRAMMAR_ROWS,
    PairDrafter,
    PairModel,
    chain_constraint,
    check_lengths,
    grammar_drafts,
    random_pair_chain,
    reference_rows,
    sample_serial,
    sequential_chi_square,
)

from openalice_runner.engine import rejection
from openalice_runner.engine.types import SamplingParams, SpecConfig

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors (conftest.py)


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
    if drafter != "none":  # drafts of full length, accepted and rejected late, accepted whole (γ 1: full length only)
        check_lengths(run, gamma, N_MASKED)
    assert masked_p(target, run, sampling) > 1e-3


def test_unmasked_draft_distribution_is_caught(monkeypatch):
    # A broken constrained sampler: verify against the drafter's raw q (mass on forbidden tokens
    # included) instead of q masked and renormalised: accept and residual are both off.
    monkeypatch.setattr("openalice_runner.engine.settle.masked_probs", lambda q, allowed: q)
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
