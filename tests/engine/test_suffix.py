"""The `suffix` drafter: prompt lookup over the request's tokens plus suffix lookup over recent
responses of other requests; exact (greedy output equals no speculation; the chi-square test of
sampling is in engine/grammar/test_sampling_exact.py)."""

from __future__ import annotations

import pytest

from openalice_runner.engine import Engine, SamplingParams, SpecConfig
from openalice_runner.engine.drafters.suffix import RecentResponses, SuffixDrafter


def test_recent_responses_match_the_longest_suffix_in_other_responses():
    shared = RecentResponses(keep=2, n_min=2, n_max=4)
    a = shared.open()
    shared.extend(a, [1, 2, 3, 4, 5, 6])
    b = shared.open()
    shared.extend(b, [9, 2, 3, 7])
    assert shared.match([0, 2, 3], 3, exclude=None) == ([7], 2)  # the latest occurrence
    assert shared.match([0, 2, 3], 3, exclude=b) == ([4, 5, 6], 2)  # a request skips its own
    assert shared.match([1, 2, 3], 2, exclude=b) == ([4, 5], 3)  # longer suffix wins
    assert shared.match([8, 3], 3, exclude=None) == ([], 0)  # too short a match
    c = shared.open()  # keep=2: the oldest is forgotten, its n-grams too
    shared.extend(c, [5, 5])
    assert shared.match([1, 2, 3], 3, exclude=None) == ([7], 2)
    shared.extend(a, [1, 1])  # a forgotten response takes no more tokens
    assert shared.match([1, 1], 1, exclude=None) == ([], 0)


def test_drafts_from_another_requests_output():
    shared = RecentResponses()
    earlier = SuffixDrafter(shared)
    earlier.start([100, 101])
    sampling = SamplingParams(max_tokens=8)
    earlier.propose([100, 101, 7, 8, 9, 10, 11, 12], 4, sampling, None)  # publishes its output
    later = SuffixDrafter(shared)
    later.start([200, 7, 8, 9])
    proposal = later.propose([200, 7, 8, 9], 3, sampling, None)
    assert proposal.tokens == [10, 11, 12]


@pytest.mark.parametrize("max_batch", [4, 1])
def test_greedy_output_equals_no_speculation(max_batch):
    engine = Engine.tiny_random(seed=3, max_batch=max_batch)
    sampling = SamplingParams(max_tokens=32)
    prompts = [engine.encode(t) for t in ("The quick brown fox jumps over the lazy dog.",
                                         "def add(a, b):\n    return a + b\n\ndef sub(a, b):",
                                         "The quick brown fox jumps")]
    drafted = 0
    for prompt in prompts:
        plain = engine.generate(prompt, sampling)
        for gamma in (2, 6):
            spec = engine.generate(prompt, sampling, SpecConfig(method="suffix", gamma=gamma))
            assert spec.token_ids == plain.token_ids
            assert spec.stats.method == "suffix"
            drafted += spec.stats.proposed
    assert drafted > 0
