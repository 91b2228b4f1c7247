"""n-gram (prompt lookup) search: hand-worked cases and the index against a plain scan."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from locations import REPO

from openalice_runner.engine.cost_model import PassCostModel
from openalice_runner.engine.drafters.ngram import (
    KEEP_OCCURRENCES,
    MATCH_CAP,
    AcceptanceByMatch,
    NgramDrafter,
    NgramIndex,
    find_continuation,
    find_match,
)
from openalice_runner.engine.types import SamplingParams


def lookup(context, n_min=1, n_max=4, k=5):
    index = NgramIndex(n_min, n_max)
    index.extend(context)
    return index.lookup(k)


def test_longest_match_wins():
    # suffix [1, 2, 3]: the 3-gram occurs once (followed by 9); the 1-gram [3] also at the end (followed by 7)
    context = [1, 2, 3, 9, 9, 5, 3, 7, 1, 2, 3]
    assert lookup(context) == [9, 9, 5, 3, 7]
    assert find_continuation(context, 1, 4, 5) == [9, 9, 5, 3, 7]


def test_latest_occurrence_wins_for_equal_length():
    context = [4, 5, 6, 4, 5, 8, 4, 5]
    # the 2-gram [4, 5] occurs at 0 (-> 6) and 3 (-> 8); the latest is used
    assert lookup(context, 1, 2, 3) == [8, 4, 5]


def test_nothing_proposed_without_a_match():
    assert lookup([1, 2, 3, 4]) == []
    assert lookup([7]) == []
    assert lookup([]) == []


def test_n_min_limits_short_matches():
    context = [1, 2, 9, 3, 2]
    assert lookup(context, n_min=1, n_max=3, k=2) == [9, 3]
    assert lookup(context, n_min=2, n_max=3, k=2) == []


def test_proposal_is_capped_by_gamma_and_context_end():
    context = [1, 2, 3, 1, 2]
    assert lookup(context, k=2) == [3, 1]
    assert lookup(context, k=10) == [3, 1, 2]


def test_incremental_extension_equals_fresh_index():
    context = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4, 3, 3, 8, 3, 2, 7, 9, 5]
    incremental = NgramIndex(1, 3)
    for i, t in enumerate(context):
        incremental.extend([t])
        assert incremental.lookup(4) == find_continuation(context[: i + 1], 1, 3, 4)


def test_drafter_follows_growing_history():
    drafter = NgramDrafter(1, 3)
    prompt = [10, 11, 12, 13, 14, 10, 11]
    drafter.start(prompt)
    assert drafter.propose(prompt, 3, SamplingParams(), None).tokens == [12, 13, 14]
    history = prompt + [12, 13, 99]
    assert drafter.propose(history, 3, SamplingParams(), None).tokens == []
    assert drafter.propose(history + [10], 2, SamplingParams(), None).tokens == [11, 12]


def dear_passes() -> PassCostModel:
    costs = PassCostModel()
    costs.record(1, 0.010)
    for rows in range(2, 10):
        costs.record(rows, 0.030)  # every multi-row pass costs three plain steps
    return costs


def test_gated_drafter_declines_weak_matches_and_probes_now_and_then():
    """A one-token match (prior α 0.25) cannot pay for a pass that costs 3 plain steps: the
    drafter proposes nothing, except every `probe_every`-th time a short draft marked probe."""
    drafter = NgramDrafter(1, 4, costs=dear_passes(), probe_every=4)
    history = [5, 6, 7, 8, 9, 1, 2, 3, 5]  # suffix (5,) matched once, longer suffixes not
    drafter.start(history)
    proposals = [drafter.propose(history, 5, SamplingParams(), None) for _ in range(8)]
    probes = [p for p in proposals if p.tokens]
    assert len(probes) == 2 and all(p.probe and p.tokens == [6, 7] for p in probes)
    assert all(not p.probe for p in proposals if not p.tokens)


def test_gated_drafter_proposes_in_earnest_where_it_expects_a_gain():
    cheap = PassCostModel()
    cheap.record(1, 0.010)
    for rows in range(2, 10):
        cheap.record(rows, 0.011)
    drafter = NgramDrafter(1, 4, costs=cheap)
    history = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 4]  # a 4-token match
    drafter.start(history)
    proposal = drafter.propose(history, 4, SamplingParams(), None)
    assert proposal.tokens == [5, 6, 7, 8] and not proposal.probe


def linear_passes(rows_max: int = 40) -> PassCostModel:
    costs = PassCostModel()
    for rows in range(1, rows_max + 1):
        costs.record(rows, 0.010 + 0.002 * rows)  # compute grows with every row
    return costs


def test_gated_drafter_weighs_its_draft_against_the_whole_batch():
    """A 4-token match pays alone (4 more rows on top of 1), but not in a step where 8
    sequences decode: the draft would slow all eight for about one extra token."""
    history = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 4]
    alone = NgramDrafter(1, 4, costs=linear_passes(), probe_every=1000)
    alone.start(history)
    drafted = alone.propose(history, 4, SamplingParams(), None).tokens
    assert drafted and drafted == [5, 6, 7, 8][: len(drafted)]
    crowded = NgramDrafter(1, 4, costs=linear_passes(), probe_every=1000)
    crowded.start(history)
    crowded.step_load(batch=8, rows=8)
    assert crowded.propose(history, 4, SamplingParams(), None).tokens == []


def test_pass_cost_grows_beyond_what_was_measured():
    costs = PassCostModel()
    costs.record(1, 0.01)
    costs.record(8, 0.02)
    assert costs.ratio(8) == 2.0
    assert costs.ratio(4) == 2.0  # the nearest measured count above
    assert costs.ratio(16) == 4.0  # linear beyond the largest measured


def test_pass_costs_are_kept_per_context():
    """A long context makes extra rows dearer (each reads the whole context): a question about
    a short context is answered from short-context passes, where they cover it, and from all
    passes where they do not."""
    from openalice_runner.engine.cost_model import context_bucket

    assert [context_bucket(n) for n in (0, 127, 128, 255, 256, 900, 1024)] == [0, 0, 1, 1, 2, 3, 4]
    costs = PassCostModel()
    costs.record(1, 0.010, context=150)
    costs.record(9, 0.012, context=160)  # short context: 9 rows cost 1.2 plain steps
    costs.record(1, 0.015, context=900)
    costs.record(9, 0.030, context=910)  # long context: 2.0
    assert costs.ratio(9, context=170) == pytest.approx(1.2)
    assert costs.ratio(9, context=905) == pytest.approx(2.0)
    assert costs.ratio(5, context=200) == pytest.approx(1.2)  # nearest measured count above
    # over all passes (no context, or a bucket that has not timed enough): EMAs of both
    everywhere = costs.ratio(9)
    assert 1.2 < everywhere < 2.0 and costs.ratio(9, context=3000) == everywhere
    assert costs.ratio(16, context=150) == costs.ratio(16)  # beyond the bucket's rows
    costs.record(2, 0.02)  # a pass without a context counts over all passes only
    assert costs.ratio(2, context=150) == pytest.approx(1.2)


def test_drafters_ask_for_the_cost_at_their_context():
    """The same 4-token match pays where verify rows are cheap at this context and is declined
    where they are dear, whatever the other contexts cost."""
    history = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 4]  # 12 tokens: bucket 0
    costs = PassCostModel()
    costs.record(1, 0.010, context=12)
    costs.record(5, 0.040, context=16)  # 4 plain steps: no 4-token draft can pay
    costs.record(1, 0.010, context=1000)
    for _ in range(20):
        costs.record(5, 0.0105, context=1004)  # all passes: cheap on average
    assert costs.ratio(5) < 1.5
    drafter = NgramDrafter(1, 4, costs=costs, probe_every=1000)
    drafter.start(history)
    assert drafter.propose(history, 4, SamplingParams(), None).tokens == []
    far = history + list(range(100, 1100)) + [1, 2, 3, 4]  # the same match at a 1016-token context
    drafter = NgramDrafter(1, 4, costs=costs, probe_every=1000)
    drafter.start(far)
    assert drafter.propose(far, 4, SamplingParams(), None).tokens == [100, 101, 102, 103]


def test_engine_times_passes_so_the_first_requests_are_sized():
    """An engine that only ever runs speculating requests may never run a one-row pass: it times
    passes itself at start, so drafters size their drafts from the first request on."""
    from openalice_runner.engine import Engine

    engine = Engine.tiny_random(seed=1, max_batch=2)
    assert engine.pass_costs.seconds(1) is None
    engine.time_passes(rows=(1, 4), context=16, repeats=2)
    assert engine.pass_costs.seconds(1) > 0 and engine.pass_costs.measured_above(1)
    assert engine.pass_costs.ratio(4) > 0


@settings(max_examples=300, deadline=None)
@given(
    context=st.lists(st.integers(0, 5), max_size=60),
    n_min=st.integers(1, 3),
    extra=st.integers(0, 3),
    k=st.integers(1, 8),
)
def test_index_matches_plain_scan(context, n_min, extra, k):
    n_max = n_min + extra
    assert lookup(context, n_min, n_max, k) == find_continuation(context, n_min, n_max, k)


def match_by_scan(context, n_min, n_max, k):
    """Reference: the longest suffix that occurs earlier (a plain scan); of its latest
    KEEP_OCCURRENCES occurrences the one whose preceding tokens equal those before the end furthest
    back (counted up to MATCH_CAP, or n), the latest on a tie; (continuation, agreement)."""
    for n in range(min(n_max, len(context) - 1), n_min - 1, -1):
        starts = [s for s in range(len(context) - n - 1, -1, -1) if context[s : s + n] == context[-n:]]
        best = None
        for start in starts[:KEEP_OCCURRENCES]:
            length = n
            while (length < MATCH_CAP and start - (length - n) - 1 >= 0
                   and context[start - (length - n) - 1] == context[-length - 1]):
                length += 1
            if best is None or length > best[0]:
                best = (length, start + n)
        if best:
            return context[best[1] : best[1] + k], best[0]
    return [], 0


def test_match_reports_how_far_back_the_occurrence_agrees():
    body = list(range(100, 120))
    # inside a copy: the 4-gram's occurrence agrees for every token before it (all 16 of them)
    index = NgramIndex(1, 4)
    index.extend(body + [7] + body[:16])
    assert index.match(3) == ([116, 117, 118], 16)
    # the same 4-gram recurring after other text: it agrees for its own 4 tokens only
    index = NgramIndex(1, 4)
    index.extend(body + [7, 300, 301] + body[12:16])
    assert index.match(3) == ([116, 117, 118], 4)
    # the agreement is looked at up to MATCH_CAP tokens
    index = NgramIndex(1, 4)
    index.extend(body * 2)
    assert index.match(2) == ([100, 101], MATCH_CAP)


@settings(max_examples=500, deadline=None)
@given(
    context=st.lists(st.integers(0, 3), max_size=120),
    n_min=st.integers(1, 3),
    extra=st.integers(0, 3),
    k=st.integers(1, 8),
)
def test_match_and_agreement_equal_a_plain_scan(context, n_min, extra, k):
    n_max = n_min + extra
    index = NgramIndex(n_min, n_max)
    index.extend(context)
    assert index.match(k) == match_by_scan(context, n_min, n_max, k) == find_match(context, n_min, n_max, k)


def test_match_takes_the_occurrence_that_agrees_furthest_back():
    body = list(range(100, 120))
    # body[12:16] occurs in the copy under way's source (agreeing 16 back) and later after other
    # text (agreeing 4): the source's continuation is taken, not the latest occurrence's
    context = body + [7] + [300, 301] + body[12:16] + [55, 56] + body[:16]
    index = NgramIndex(1, 4)
    index.extend(context)
    assert index.match(3) == ([116, 117, 118], 16)
    # with the source older than the KEEP_OCCURRENCES latest occurrences, the latest of those wins
    recurring = [v for _ in range(KEEP_OCCURRENCES) for v in [300, 301, *body[12:16], 55]]
    index = NgramIndex(1, 4)
    index.extend(body + [7] + recurring + body[:16])
    assert index.match(1) == ([55], 4)


def test_acceptance_classes_cover_every_length():
    acceptance = AcceptanceByMatch()
    assert [acceptance.length_class(n) for n in (1, 4, 5, 7, 8, 15, 16, 40)] == [0, 3, 4, 4, 5, 5, 6, 6]
    acceptance.update(6, proposed=4, accepted=4)  # evidence for 5-7 moves 5-7 only
    assert acceptance.alpha(5) == acceptance.alpha(7) > AcceptanceByMatch().alpha(5)
    assert acceptance.alpha(8) == AcceptanceByMatch().alpha(8)


def test_drafter_drafts_longer_inside_a_long_copy():
    """The same 4-token match, once agreeing for 16 tokens (a copy under way) and once for its own
    4: at the same pass costs the drafter proposes more of the first."""
    body = list(range(100, 120))
    continuation = body[16:] + [7] + body[:4]
    proposals = []
    for history in (body + [7] + body[:16], [200, 201, 202, 203] + body + [7, 300, 301] + body[12:16]):
        drafter = NgramDrafter(1, 4, costs=linear_passes(), probe_every=1000)
        drafter.start(history)
        proposals.append(drafter.propose(history, 8, SamplingParams(), None).tokens)
    inside, recurring = proposals
    assert recurring and inside == continuation[: len(inside)] and recurring == continuation[: len(recurring)]
    assert len(inside) > len(recurring)


def test_ceiling_replay_counts_passes_with_free_verification():
    import importlib.util

    path = REPO / "openalice_runner" / "bench" / "ngram_ceiling.py"
    spec = importlib.util.spec_from_file_location("ngram_ceiling", path)
    ceiling = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ceiling)
    prompt = [7, 1, 2, 3, 4, 5, 6, 9]
    # the reply copies 1..6 after a fresh token: one pass for 7 (nothing to match after 9),
    # then "7 -> 1 2 3 4 5 6" is found: one pass takes 6 drafts plus the target's next token
    assert ceiling.passes_with_free_verification(prompt, [7, 1, 2, 3, 4, 5, 6, 8], 4, 16) == 2
    # 8 is new, the second 8 has no earlier 8 to follow yet, the third is "8 -> 8" from the first
    assert ceiling.passes_with_free_verification(prompt, [8, 8, 8], 4, 16) == 3
    assert ceiling.passes_with_free_verification(prompt, [7, 1, 2, 3, 4, 5, 6, 8], 4, 2) == 4  # γ caps each pass
