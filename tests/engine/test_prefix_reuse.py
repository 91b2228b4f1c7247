"""Prefix reuse: a prompt that starts like a finished request's tokens prefills only the rest.

An agent loop sends its history again with every call. The batching engine keeps a finished
sequence's keys and values in its free slot; the next request takes the slot with the longest
matching prefix. Reuse must be exact (greedy output equal to a full prefill, fp32 and bf16),
must pick the right slot, and must stay out of the way of drafters that read hidden states.
"""

from __future__ import annotations

import threading

import pytest
import torch

from openalice_runner.engine import Engine, SamplingParams, SpecConfig
from openalice_runner.engine.cpu_kernels import cpu_kernels
from openalice_runner.engine.drafters.ngram import NgramDrafter
from openalice_runner.engine.prefixes import common_prefix

HISTORY = "The quick brown fox jumps over the lazy dog. The quick brown fox"


def engines(dtype: str):
    """The same tiny model twice: with prefix reuse, and without (the reference)."""
    return (Engine.tiny_random(seed=3, dtype=dtype, max_batch=4, prefix_reuse=True),
            Engine.tiny_random(seed=3, dtype=dtype, max_batch=4))


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_follow_up_call_reuses_the_history_and_matches_a_full_prefill(dtype):
    if dtype == "bf16" and cpu_kernels() is None:
        pytest.skip("bf16 row invariance needs the engine's own kernels")
    reuse, plain = engines(dtype)
    sampling = SamplingParams(max_tokens=24)
    first = reuse.encode(HISTORY)
    a = reuse.generate(first, sampling, SpecConfig(method="ngram", gamma=3))
    assert a.stats.cached_prompt_tokens == 0
    # the next call: the history, the reply, and a new message
    second = first + a.token_ids + reuse.encode(" And then the dog")
    b = reuse.generate(second, sampling, SpecConfig(method="ngram", gamma=3))
    # all but the reply's last token, which was emitted and never fed
    assert b.stats.cached_prompt_tokens == len(first) + len(a.token_ids) - 1
    assert b.token_ids == plain.generate(second, sampling).token_ids
    # the same prompt again: everything but its last token
    c = reuse.generate(second, sampling)
    assert c.stats.cached_prompt_tokens == len(second) - 1
    assert c.token_ids == b.token_ids


def test_reuse_picks_the_longest_prefix_and_keeps_recent_histories():
    engine = Engine.tiny_random(seed=3, max_batch=4, prefix_reuse=True)
    sampling = SamplingParams(max_tokens=8)
    x = engine.encode("alpha beta gamma delta epsilon zeta eta theta")
    y = engine.encode("one two three four five six seven eight nine")
    # grow the cache to 4 slots with 4 concurrent requests, so that free slots hold nothing yet
    start = threading.Barrier(4)

    def one(prompt):
        start.wait()
        return engine.generate(prompt, sampling)

    threads = [threading.Thread(target=one, args=(p,)) for p in (x, y, x[:3], y[:3])]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    rx = engine.generate(x, sampling)
    ry = engine.generate(y, sampling)
    assert rx.stats.cached_prompt_tokens == len(x) - 1 and ry.stats.cached_prompt_tokens == len(y) - 1
    # unrelated prompts take slots that hold nothing or were freed longest ago
    for text in ("lorem ipsum dolor", "sit amet consectetur"):
        assert engine.generate(engine.encode(text), sampling).stats.cached_prompt_tokens == 0
    # both recent histories are still there
    assert engine.generate(x + rx.token_ids, sampling).stats.cached_prompt_tokens == len(x) + len(rx.token_ids) - 1
    assert engine.generate(y + ry.token_ids, sampling).stats.cached_prompt_tokens >= len(y)


def test_drafters_that_read_hidden_states_and_cannot_take_over_prefill_in_full():
    """A drafter that reads hidden states but has no `reuse` of its own (the eagle drafter has
    one: tests/engine/test_eagle.py) must observe every prompt position."""
    class ReadsHidden(NgramDrafter):
        wants_hidden = True

        def __init__(self):
            super().__init__()
            self.rows = 0

        def observe(self, hidden: torch.Tensor) -> None:
            self.rows += hidden.shape[0]

    engine = Engine.tiny_random(seed=3, max_batch=4, prefix_reuse=True)
    prompt = engine.encode(HISTORY)
    engine.generate(prompt, SamplingParams(max_tokens=4))
    drafter = ReadsHidden()
    out = engine.generate(prompt, SamplingParams(max_tokens=4), SpecConfig(method="ngram", gamma=2), drafter=drafter)
    assert out.stats.cached_prompt_tokens == 0
    assert drafter.rows >= len(prompt)  # it saw every prompt position


def test_off_by_default_and_on_the_serial_loop():
    for engine in (Engine.tiny_random(seed=3, max_batch=4), Engine.tiny_random(seed=3, max_batch=1)):
        prompt = engine.encode(HISTORY)
        engine.generate(prompt, SamplingParams(max_tokens=4))
        assert engine.generate(prompt, SamplingParams(max_tokens=4)).stats.cached_prompt_tokens == 0


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 4, 5], 10) == 2
    assert common_prefix([1, 2, 3], [1, 2, 3, 4], 10) == 3
    assert common_prefix([1, 2, 3], [1, 2, 3, 4], 2) == 2
    assert common_prefix([], [1], 0) == 0
    assert common_prefix([5], [1], 1) == 0


def _wait_for(predicate, seconds: float = 10.0) -> bool:
    import time

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


def test_an_idle_engine_gives_back_cache_memory_and_keeps_its_histories():
    engine, plain = engines("fp32")
    scheduler = engine.scheduler
    scheduler.idle_shrink_s = 0.05
    prompt = engine.encode(HISTORY)
    # a long reply grows the cache a granule at a time; it is cut short once past 1024 positions
    cancel = threading.Event()
    tokens: list[int] = []
    for event in engine.stream(prompt, SamplingParams(max_tokens=1200), cancel=cancel):
        tokens += event.token_ids
        if scheduler.cache.max_len >= 1024:
            cancel.set()
    grown = scheduler.cache.max_len
    assert grown >= 1024
    # idle: the cache shrinks to what the kept history needs, and the history stays usable
    assert _wait_for(lambda: scheduler.cache.max_len < grown)
    assert scheduler.cache.max_len == 512 and scheduler.cache.batch == 1
    follow_up = prompt + tokens + engine.encode(" and then")
    sampling = SamplingParams(max_tokens=16)
    out = engine.generate(follow_up, sampling)
    assert out.stats.cached_prompt_tokens >= len(prompt)
    assert out.token_ids == plain.generate(follow_up, sampling).token_ids


def test_without_histories_an_idle_engine_keeps_no_slots():
    engine = Engine.tiny_random(seed=3, max_batch=4)
    engine.scheduler.idle_shrink_s = 0.05
    prompt = engine.encode(HISTORY)
    first = engine.generate(prompt, SamplingParams(max_tokens=8))
    assert _wait_for(lambda: engine.scheduler.cache.batch == 0)
    assert engine.scheduler.cache.nbytes() == 0
    assert engine.generate(prompt, SamplingParams(max_tokens=8)).token_ids == first.token_ids
    engine.scheduler.idle_shrink_s = None  # never: the cache keeps its size
    # The idle loop's wait is what a shrink would follow, when it times out. Recorded: once idle
    # after this request, the loop waits with no timeout at all, so nothing ever wakes it to shrink
    # (seen by the event, not by the absence of a shrink within some time, which a slow machine fakes).
    cond, waits = engine.scheduler._cond, []
    real_wait = cond.wait
    cond.wait = lambda timeout=None: waits.append(timeout) or real_wait(timeout)
    try:
        engine.generate(prompt, SamplingParams(max_tokens=8))
        assert _wait_for(lambda: waits, seconds=60)
        assert waits == [None] and engine.scheduler.cache.batch > 0
    finally:
        del cond.wait


def test_serial_loop_reuses_the_last_history_and_matches_a_full_prefill():
    reuse = Engine.tiny_random(seed=3, max_batch=1, prefix_reuse=True)
    plain = Engine.tiny_random(seed=3, max_batch=1)
    assert reuse.scheduler is None
    sampling = SamplingParams(max_tokens=24)
    first = reuse.encode(HISTORY)
    a = reuse.generate(first, sampling, SpecConfig(method="ngram", gamma=3))
    assert a.stats.cached_prompt_tokens == 0
    second = first + a.token_ids + reuse.encode(" And then the dog")
    b = reuse.generate(second, sampling, SpecConfig(method="ngram", gamma=3))
    assert b.stats.cached_prompt_tokens == len(first) + len(a.token_ids) - 1
    assert b.token_ids == plain.generate(second, sampling).token_ids
    # an unrelated prompt overwrites the one history the serial cache holds
    other = reuse.encode("lorem ipsum dolor sit amet")
    assert reuse.generate(other, sampling).stats.cached_prompt_tokens == 0
    assert reuse.generate(second, sampling).stats.cached_prompt_tokens == 0


@pytest.mark.parametrize("max_batch", [4, 1])
def test_reuse_across_a_retokenised_history(max_batch):
    """The loop sends the reply back as text; re-rendered, it splits into other tokens than the
    model generated. With a conversation id the provider builds the prompt from the generated ids
    up to the first character that differs, so the cache covers the previous prompt and reply."""
    import asyncio

    from openalice_runner.providers.base import CallContext
    from openalice_runner.providers.local import EmbeddedConfig, EmbeddedProvider
    from openalice_runner.types import ChatRequest

    engine = Engine.tiny_random(seed=3, max_batch=max_batch, prefix_reuse=True)
    provider = EmbeddedProvider("local", EmbeddedConfig.model_validate({"type": "local", "max_batch": max_batch}),
                             engine=engine)
    ctx = CallContext(conversation_id="loop-1")

    def call(messages, max_tokens):
        body = {"model": "m", "messages": messages, "max_tokens": max_tokens, "temperature": 0}
        return asyncio.run(provider.chat(ChatRequest.model_validate(body), ctx))

    messages = [{"role": "user", "content": "Tell me about foxes."}]
    first = engine.render_chat(messages)
    a = call(messages, 24)
    generated = provider._histories.get("loop-1")[len(first):]
    assert len(generated) == a.usage.completion_tokens == 24
    follow_up = [*messages, {"role": "assistant", "content": a.choices[0].message.content},
                 {"role": "user", "content": "And their dens?"}]
    rendered = engine.render_chat(follow_up)
    # the premise: re-tokenised, the history parts from the generated ids inside the reply
    assert common_prefix(first + generated, rendered, len(rendered)) < len(first) + len(generated) - 1
    b = call(follow_up, 12)
    assert b.usage.prompt_tokens_details.cached_tokens >= len(first) + len(generated) - 1
    # the same text, split as the model generated it, and exact: a full prefill of the same ids agrees
    aligned = provider._histories.get("loop-1")[: b.usage.prompt_tokens]
    assert engine.tokenizer.decode(aligned) == engine.tokenizer.decode(rendered)
    reference = Engine.tiny_random(seed=3, max_batch=max_batch).generate(aligned, SamplingParams(max_tokens=12))
    assert b.choices[0].message.content == reference.text
    # without a conversation id the prompt is the plain rendering: reuse stops at the seam
    c = asyncio.run(provider.chat(ChatRequest.model_validate(
        {"model": "m", "messages": follow_up, "max_tokens": 4, "temperature": 0}), CallContext()))
    assert c.usage.prompt_tokens == len(rendered)


def test_align_prompt_keeps_the_text_and_gains_or_leaves_the_prompt():
    from openalice_runner.engine.histories import ConversationHistories, align_prompt

    tok = Engine.tiny_random(seed=3, max_batch=1).tokenizer
    text = "Hello world, the quick brown fox."
    natural = tok.encode(text, add_special_tokens=False)
    by_char = [i for c in "Hello world," for i in tok.encode(c, add_special_tokens=False)]
    aligned = align_prompt(tok, by_char, natural)
    assert aligned[: len(by_char)] == by_char and tok.decode(aligned) == text
    assert align_prompt(tok, natural, natural + [5]) == natural + [5]  # already a prefix: as is
    assert align_prompt(tok, tok.encode("Goodbye"), natural) == natural  # nothing in common
    histories = ConversationHistories(capacity=2)
    for name in ("a", "b", "c"):
        histories.put(name, [1, 2])
    assert histories.get("a") is None and histories.get("c") == [1, 2] and len(histories) == 2
    histories.put(None, [1])
    assert histories.get(None) is None


WEATHER_TOOLS = [  # closed values: a random model's forced call closes within a few tokens
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather for a city",
     "parameters": {"type": "object", "properties": {"city": {"enum": ["Lisbon", "Porto"]}},
                    "required": ["city"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["utc", "local"]}}, "required": ["zone"],
        "additionalProperties": False}}},
]


@pytest.mark.parametrize("max_batch", [4, 1])
def test_reuse_across_calls_with_different_tool_choices(max_batch):
    """A loop forces its first call (tool_choice "required") and not the next ones: the prompt's
    prefix must not depend on tool_choice, so each call's prompt starts with the previous call's
    prompt and reply, and only the new messages are prefilled."""
    import asyncio

    from openalice_runner.providers.base import CallContext
    from openalice_runner.providers.local import EmbeddedConfig, EmbeddedProvider
    from openalice_runner.types import ChatRequest

    engine = Engine.tiny_random(seed=3, max_batch=max_batch, prefix_reuse=True)
    provider = EmbeddedProvider("local", EmbeddedConfig.model_validate({"type": "local", "max_batch": max_batch}),
                             engine=engine)
    ctx = CallContext(conversation_id="loop-tools")
    messages = [{"role": "system", "content": "You are Alice, a concise assistant."},
                {"role": "user", "content": "What's the weather in Lisbon?"}]
    held = 0  # the previous call's prompt + reply, in tokens
    for i, choice in enumerate(["required", "auto", {"type": "function", "function": {"name": "get_time"}},
                                "none"]):
        # 32: a required call's shortest valid reply here is 22 tokens; a smaller budget is refused
        body = {"model": "m", "messages": messages, "tools": WEATHER_TOOLS, "tool_choice": choice,
                "max_tokens": 32, "temperature": 0, "parallel_tool_calls": False}
        r = asyncio.run(provider.chat(ChatRequest.model_validate(body), ctx))
        if i == 0:
            assert r.usage.prompt_tokens_details.cached_tokens == 0
            assert r.finish_reason == "tool_calls"  # the premise: call 1 is a forced call
        else:
            assert r.usage.prompt_tokens_details.cached_tokens >= held - 1, (i, choice)
        held = r.usage.prompt_tokens + r.usage.completion_tokens
        message = r.choices[0].message
        messages = [*messages, message.model_dump(exclude_none=True)]
        for call in message.tool_calls or []:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": '{"temperature_c": 17}'})
        if not message.tool_calls:
            messages.append({"role": "user", "content": "And tomorrow?"})
