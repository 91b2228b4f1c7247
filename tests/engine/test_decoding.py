"""Stopping, budgets, context limit, streaming and the reported figures."""

from __future__ import annotations

import threading

import pytest

from openalice_runner.engine import ContextLengthError, SamplingParams, SpecConfig


def test_max_tokens_and_figures(tiny_engine):
    prompt = tiny_engine.encode("hello world, hello world, hello")
    r = tiny_engine.generate(prompt, SamplingParams(max_tokens=17), SpecConfig(method="ngram", gamma=4))
    s = r.stats
    assert s.completion_tokens == len(r.token_ids) <= 17
    assert s.finish_reason in ("length", "stop")
    assert s.prompt_tokens == len(prompt)
    assert s.method == "ngram" and s.gamma == 4
    assert s.accepted <= s.proposed
    assert sum(s.accept_length_histogram) <= s.target_passes
    assert s.ttft_s > 0 and s.total_s >= s.ttft_s and s.tokens_per_second > 0
    assert s.verify_s > 0 and s.draft_s >= 0


@pytest.mark.parametrize("method", ["off", "ngram", "draft"])
def test_stop_string_cuts_text_and_stream(tiny_engine, method):
    prompt = tiny_engine.encode("a b c")
    full = tiny_engine.generate(prompt, SamplingParams(max_tokens=40))
    assert len(full.text) > 10
    stop = full.text[8:11]
    cut_at = full.text.find(stop)
    events = list(tiny_engine.stream(prompt, SamplingParams(max_tokens=40, stop=(stop,)),
                                     SpecConfig(method=method, gamma=3)))
    result = events[-1].result
    assert result.text == full.text[:cut_at]
    assert "".join(e.text for e in events) == result.text  # the stream never showed the stop string
    assert result.finish_reason == "stop"
    # the tokens up to the one that completes the stop string, whatever a pass accepted (passes
    # that accepted several tokens once kept only those up to where the stop string began)
    completes = next(n for n in range(1, len(full.token_ids) + 1)
                     if stop in tiny_engine.tokenizer.decode(full.token_ids[:n], skip_special_tokens=True))
    assert result.token_ids == full.token_ids[:completes]
    assert result.stats.completion_tokens == completes


def test_eos_ends_generation(tiny_engine):
    prompt = tiny_engine.encode("x")
    eos = next(iter(tiny_engine.eos_token_ids))
    original = tiny_engine.eos_token_ids
    first = tiny_engine.generate(prompt, SamplingParams(max_tokens=30)).token_ids
    cut = next(i for i, t in enumerate(first) if i > 0 and t not in first[:i])
    try:
        tiny_engine.eos_token_ids = frozenset({first[cut], eos})
        r = tiny_engine.generate(prompt, SamplingParams(max_tokens=30), SpecConfig(method="ngram"))
    finally:
        tiny_engine.eos_token_ids = original
    assert r.token_ids == first[:cut] and r.finish_reason == "stop"


@pytest.mark.parametrize("method", ["off", "ngram"])
def test_a_reply_ending_on_its_stop_token_reports_at_least_one_token_per_pass(tiny_engine, method):
    """Every target pass produces at least one token; the one whose token is the stop token too (a
    plain reply of 30 passes and 30 tokens once reported 0.967 tokens per pass)."""
    prompt = tiny_engine.encode("x")
    first = tiny_engine.generate(prompt, SamplingParams(max_tokens=30)).token_ids
    cut = next(i for i, t in enumerate(first) if i > 3 and t not in first[:i])
    original = tiny_engine.eos_token_ids
    try:
        tiny_engine.eos_token_ids = frozenset({first[cut]})
        r = tiny_engine.generate(prompt, SamplingParams(max_tokens=30), SpecConfig(method=method, gamma=3))
    finally:
        tiny_engine.eos_token_ids = original
    s = r.stats
    assert r.finish_reason == "stop" and r.token_ids == first[:cut]
    assert s.tokens_per_pass >= 1.0
    if method == "off":
        assert s.target_passes == cut and s.tokens_per_pass == 1.0  # the prefill gave the first token


def test_context_limit(tiny_engine):
    ctx = tiny_engine.context_length
    with pytest.raises(ContextLengthError):
        tiny_engine.generate(list(range(10, 10 + ctx)), SamplingParams(max_tokens=5))
    r = tiny_engine.generate(list(range(10, 10 + ctx - 3)), SamplingParams(max_tokens=50),
                             SpecConfig(method="ngram", gamma=8))
    assert r.stats.completion_tokens <= 3 and r.finish_reason == "length"


def test_stream_yields_text_as_accepted(tiny_engine):
    prompt = tiny_engine.encode("once upon a time")
    events = list(tiny_engine.stream(prompt, SamplingParams(max_tokens=20), SpecConfig(method="ngram")))
    assert len(events) >= 3
    assert events[-1].result is not None
    tokens = [t for e in events for t in e.token_ids]
    assert tokens == events[-1].result.token_ids
    assert "".join(e.text for e in events) == events[-1].result.text


def test_cancel_stops_between_rounds(tiny_engine):
    cancel = threading.Event()
    prompt = tiny_engine.encode("count")
    stream = tiny_engine.stream(prompt, SamplingParams(max_tokens=200), cancel=cancel)
    next(stream)
    cancel.set()
    rest = list(stream)
    assert rest[-1].result.finish_reason == "cancelled"
    assert rest[-1].result.stats.completion_tokens < 10


def test_seeded_sampling_is_reproducible(tiny_engine):
    prompt = tiny_engine.encode("seed")
    s = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=123, max_tokens=20)
    for method in ("off", "ngram", "draft"):
        a = tiny_engine.generate(prompt, s, SpecConfig(method=method, gamma=3))
        b = tiny_engine.generate(prompt, s, SpecConfig(method=method, gamma=3))
        assert a.token_ids == b.token_ids


def test_bad_settings_name_the_field():
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="gamma"):
        SpecConfig(method="ngram", gamma=0)
    with pytest.raises(ValueError, match="method"):
        SpecConfig(method="magic")


def test_a_stop_string_keeps_the_same_tokens_however_many_a_pass_accepted(tiny_engine):
    """One pass that accepts the whole reply and one-token passes keep the same tokens: up to the
    one that completes the stop string (the bench-constrained call that counted 18 tokens with
    forced drafts and 22 without)."""
    from openalice_runner.engine.stopping import TextStream

    ids = tiny_engine.encode('{"city": "Paris"}\n</tool_call>\nmore text after it')
    at_once = TextStream(tiny_engine.tokenizer, ("</tool_call>",))
    at_once.add(ids)
    one_by_one = TextStream(tiny_engine.tokenizer, ("</tool_call>",))
    for token in ids:
        one_by_one.add([token])
    assert at_once.text == one_by_one.text == '{"city": "Paris"}\n'
    assert at_once.token_ids == one_by_one.token_ids
    assert "</tool_call>" in tiny_engine.tokenizer.decode(at_once.token_ids)
