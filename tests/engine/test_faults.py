"""Faults named for what they are, injected into the embedded engine (serial and batching).

- The engine's input checks raise one family, `InvalidRequest`, naming the field; the local provider
  maps those, and only those, to a 400 (`ProviderBadRequest`).
- Anything else the engine raises is ours: `ProviderInternalError` before the first token (eligible
  for fallback, traceback logged), `StreamBroken` after it.
- In the batching engine a fault in one sequence (planning its round, settling it) fails that
  sequence only; a fault in the shared pass fails the pass's sequences, and the scheduler serves on.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from stand_ins.engines import tiny_engine

from openalice_runner.engine import Engine, SamplingParams, SpecConfig, batching
from openalice_runner.engine.errors import ContextLengthError, InvalidRequest
from openalice_runner.engine.grammar import GrammarError
from openalice_runner.providers.base import (
    CallContext,
    ProviderBadRequest,
    ProviderInternalError,
    StreamBroken,
)
from openalice_runner.providers.embedded.config import EmbeddedConfig
from openalice_runner.providers.local import EmbeddedProvider
from openalice_runner.types import ChatRequest

MARK = 13  # max_tokens that marks the sequence a test faults


class Injected(RuntimeError):
    """The fault a test injects: a bug of ours, not the request's."""


def local(engine) -> EmbeddedProvider:
    return EmbeddedProvider("local", EmbeddedConfig.model_validate({"type": "local"}), engine=engine)


def request(**kw) -> ChatRequest:
    return ChatRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 12, **kw})


@pytest.fixture(scope="module")
def serial():
    return Engine.tiny_random(seed=0, max_batch=1)


# ---------------------------------------------------------------- the family


def test_the_engines_input_checks_raise_one_family_naming_the_field():
    for make, param in [
        (lambda: SamplingParams(temperature=-1), "temperature"),
        (lambda: SamplingParams(top_p=0), "top_p"),
        (lambda: SamplingParams(top_k=-1), "top_k"),
        (lambda: SamplingParams(max_tokens=0), "max_tokens"),
        (lambda: SamplingParams(stop=("",)), "stop"),
        (lambda: SpecConfig(method="ngram", gamma=0), "gamma"),
        (lambda: SpecConfig(method="ngram", eagle_tree=4), "eagle_tree"),
    ]:
        with pytest.raises(InvalidRequest) as caught:
            make()
        assert caught.value.param == param and caught.value.code == "invalid_value"
    assert issubclass(ContextLengthError, InvalidRequest) and issubclass(GrammarError, InvalidRequest)
    assert ContextLengthError("x").param == "messages" and ContextLengthError("x").code == "context_length_exceeded"


def test_a_prompt_past_the_context_is_refused_by_the_engine_as_input(serial):
    with pytest.raises(ContextLengthError):
        serial.generate([1] * serial.context_length, SamplingParams(max_tokens=1))


@pytest.mark.parametrize("temperature", [5e-324, 1e-300, 9e-6])
def test_a_vanishing_temperature_decodes_greedily_not_into_a_nan_distribution(serial, temperature):
    # Found by the wire fuzzer (2026-12-04): logits / 5e-324 overflow to inf, the softmax to NaN, and
    # torch.multinomial raised inside the pass: a 500 for a temperature every wire accepts (>= 0).
    greedy = serial.generate([1, 2, 3], SamplingParams(max_tokens=6))
    tiny = serial.generate([1, 2, 3], SamplingParams(temperature=temperature, top_p=5e-324, max_tokens=6))
    assert tiny.token_ids == greedy.token_ids


# ---------------------------------------------------------------- the local provider's mapping


def _fail_engine_with(monkeypatch, engine, exc: BaseException, after_events: int = 0):
    real = engine.stream

    def stream(*args, **kwargs):
        events = real(*args, **kwargs)
        for i, event in enumerate(events):
            if i >= after_events:
                events.close()
                raise exc
            yield event

    monkeypatch.setattr(engine, "stream", stream)


@pytest.mark.parametrize("streamed", [False, True])
async def test_an_input_error_from_the_engine_is_a_bad_request_naming_its_field(monkeypatch, serial, streamed):
    _fail_engine_with(monkeypatch, serial, InvalidRequest("top_k must be >= 0", param="top_k"))
    provider = local(serial)
    with pytest.raises(ProviderBadRequest) as caught:
        if streamed:
            async with provider.stream(request(), CallContext()) as chunks:
                async for _ in chunks:
                    pass
        else:
            await provider.chat(request(), CallContext())
    assert caught.value.param == "top_k" and caught.value.status_code == 400
    assert not caught.value.fallback_ok


@pytest.mark.parametrize("streamed", [False, True])
@pytest.mark.parametrize("fault", [Injected("position 9 is beyond the cache"), ValueError("an engine bug")])
async def test_any_other_engine_error_is_internal_and_may_fall_back(monkeypatch, caplog, serial, streamed, fault):
    _fail_engine_with(monkeypatch, serial, fault)
    provider = local(serial)
    with caplog.at_level(logging.ERROR, logger="openalice_runner.providers.local"), \
            pytest.raises(ProviderInternalError) as caught:  # fmt: skip
        if streamed:
            async with provider.stream(request(), CallContext()) as chunks:
                async for _ in chunks:
                    pass
        else:
            await provider.chat(request(), CallContext())
    assert caught.value.fallback_ok and caught.value.code == "internal_error"
    assert caught.value.__cause__ is fault
    logged = [r for r in caplog.records if r.exc_info and r.exc_info[1] is fault]
    assert logged, "the fault is logged with its traceback"


async def test_an_engine_fault_after_the_first_token_breaks_the_stream(monkeypatch, serial):
    _fail_engine_with(monkeypatch, serial, Injected("mid-stream"), after_events=4)
    provider = local(serial)
    pieces = []
    with pytest.raises(StreamBroken):
        async with provider.stream(request(), CallContext()) as chunks:
            async for chunk in chunks:
                pieces.append(chunk)
    assert pieces, "the fault came after tokens went out"


async def test_the_serial_engine_serves_on_after_a_fault_in_its_pass(monkeypatch, serial):
    calls = {"n": 0}
    real = serial.model.forward

    def forward(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:  # a decode pass, after the prefill's first token
            raise Injected("a pass failed")
        return real(*args, **kwargs)

    expected = serial.generate(serial.encode("hello"), SamplingParams(max_tokens=8)).token_ids
    monkeypatch.setattr(serial.model, "forward", forward)
    with pytest.raises(Injected):
        serial.generate(serial.encode("hello"), SamplingParams(max_tokens=8))
    assert serial.generate(serial.encode("hello"), SamplingParams(max_tokens=8)).token_ids == expected


# ---------------------------------------------------------------- the batching engine


PROMPTS = ["The quick brown fox jumps over", "one two three four five one two", "def f(x):\n    return"]


def _together(engine, max_tokens: list[int], spec: SpecConfig | None = None) -> list:
    """Each prompt generated at once (greedy); a result or the exception it raised, in order."""
    start = threading.Barrier(len(PROMPTS))

    def one(i: int):
        start.wait()
        try:
            return engine.generate(engine.encode(PROMPTS[i]), SamplingParams(max_tokens=max_tokens[i]),
                                   spec or SpecConfig(method="ngram", gamma=3))
        except Exception as exc:  # noqa: BLE001 - the test looks at which it was
            return exc

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(one, range(len(PROMPTS))))


def _alone(engine, max_tokens: list[int]) -> list[list[int]]:
    return [engine.generate(engine.encode(p), SamplingParams(max_tokens=n), SpecConfig(method="ngram", gamma=3))
            .token_ids for p, n in zip(PROMPTS, max_tokens, strict=True)]  # fmt: skip


@pytest.mark.parametrize("where", ["plan_round", "settle_round"])
def test_a_fault_in_one_sequence_of_a_batch_fails_that_sequence_only(monkeypatch, where):
    engine = tiny_engine()
    assert engine.scheduler is not None
    lengths = [24, MARK, 24]
    expected = _alone(engine, lengths)
    real = getattr(batching, where)
    faulted = []

    def faulty(seq, *args, **kwargs):
        if seq.sampling.max_tokens == MARK and len(seq.tokens) > len(seq.prompt) + 2:
            faulted.append(seq)
            raise Injected(f"{where} failed")
        return real(seq, *args, **kwargs)

    monkeypatch.setattr(batching, where, faulty)
    steps = engine.scheduler.steps
    out = _together(engine, lengths)
    assert len(faulted) == 1 and isinstance(out[1], Injected)
    assert not isinstance(out[0], Exception) and not isinstance(out[2], Exception), out  # the others finished
    assert [out[0].token_ids, out[2].token_ids] == [expected[0], expected[2]]
    assert engine.scheduler.steps > steps
    monkeypatch.setattr(batching, where, real)
    assert _alone(engine, lengths) == expected  # the slot it held serves the next request


def test_a_passing_fault_in_the_shared_pass_is_run_again_and_every_sequence_finishes_exact(monkeypatch):
    """The shared pass is split in halves and run again (tests/engine/test_scheduler_faults.py pins a
    fault to one sequence): a fault that does not come back fails nobody."""
    engine = tiny_engine()
    lengths = [24, 24, 24]
    expected = _alone(engine, lengths)
    real = engine.model.forward_rows
    calls = {"n": 0, "shared": 0}

    def forward_rows(tokens, cache, row_slot, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] >= 4 and len(set(row_slot)) > 1 and not calls["shared"]:
            calls["shared"] += 1
            raise Injected("the shared pass failed")
        return real(tokens, cache, row_slot, *args, **kwargs)

    monkeypatch.setattr(engine.model, "forward_rows", forward_rows)
    out = _together(engine, lengths)
    assert calls["shared"] == 1, "a pass of several sequences failed"
    assert [r.token_ids for r in out] == expected


def test_a_fault_in_every_pass_fails_its_sequences_and_the_scheduler_carries_on(monkeypatch):
    engine = tiny_engine()
    lengths = [24, 24, 24]
    expected = _alone(engine, lengths)
    real = engine.model.forward_rows
    broken = threading.Event()

    def forward_rows(*args, **kwargs):
        if broken.is_set():
            raise Injected("every pass fails")
        return real(*args, **kwargs)

    monkeypatch.setattr(engine.model, "forward_rows", forward_rows)
    broken.set()
    out = _together(engine, lengths)
    assert all(isinstance(r, Injected) for r in out), out
    broken.clear()
    assert _alone(engine, lengths) == expected  # and the scheduler serves on
    assert engine.scheduler._thread.is_alive()


def test_a_fault_in_the_pass_spares_a_running_sequence_that_was_not_in_it(monkeypatch):
    """A long prompt waits for its prefill chunk while others decode: a pass it had no rows in fails,
    and it runs on to the same reply as alone (the old scheduler failed every running sequence)."""
    engine = Engine.tiny_random(seed=0, max_batch=4)
    scheduler = engine.scheduler
    scheduler.prefill_chunk = 8  # a step feeds 8 prompt tokens while others decode: the later prompt waits
    long_prompt = engine.encode(" ".join(["the cat sat on the mat"] * 10))
    sampling = SamplingParams(max_tokens=16)
    expected = engine.generate(long_prompt, sampling).token_ids
    real = engine.model.forward_rows
    real_submit = scheduler.submit
    spared: list[set[int]] = []
    submitted: list[object] = []
    queued = threading.Event()  # both later requests wait for a batch slot

    def submit(seq, *args, **kwargs):
        request = real_submit(seq, *args, **kwargs)
        submitted.append(request)
        if len(submitted) == 3:
            queued.set()
        return request

    def forward_rows(tokens, cache, row_slot, row_pos, *args, **kwargs):
        first = [r for r in scheduler._running if r.seq.sampling.max_tokens == 200]
        if first and not first[0].prefilling:
            # it decodes no further before both later prompts are queued: the next admission takes them
            # together, and one waits for its chunk while it decodes (without this, a loaded machine
            # could finish its 200 tokens before they arrive)
            assert queued.wait(60), "the later requests were never submitted"
        # the decoding sequence's rows break every pass they are in, from the first pass that leaves a
        # running sequence out (a pass run again in halves pins the fault to it)
        outside = {r.seq.slot for r in scheduler._running} - set(row_slot)
        decoding_rows = {r.seq.slot for r in first} & set(row_slot)
        if decoding_rows and (outside or spared):
            if not spared:
                spared.append(outside)
            raise Injected("the shared pass failed")
        return real(tokens, cache, row_slot, row_pos, *args, **kwargs)

    monkeypatch.setattr(engine.model, "forward_rows", forward_rows)
    monkeypatch.setattr(scheduler, "submit", submit)
    decoding = threading.Event()

    def first():
        try:
            for event in engine.stream(engine.encode("hi"), SamplingParams(max_tokens=200)):
                if event.token_ids:
                    decoding.set()
        except Injected as exc:
            return exc

    def later(prompt):
        assert decoding.wait(60)
        try:
            return engine.generate(prompt, sampling)
        except Injected as exc:
            return exc

    with ThreadPoolExecutor(3) as pool:
        a = pool.submit(first)
        b = pool.submit(later, long_prompt)
        c = pool.submit(later, long_prompt)
        out = [a.result(120), b.result(120), c.result(120)]
    assert spared, "no pass left a running sequence out"
    assert isinstance(out[0], Injected)  # the decoding one was in that pass
    survivors = [r for r in out[1:] if not isinstance(r, Injected)]
    # every sequence but the one whose rows break the pass finished, with the reply it has alone: those
    # the failed pass left out, and those that shared it (run again without it); the old scheduler
    # failed every running sequence, failing them all must not pass here
    assert len(survivors) == len(out) - 1, (out, spared)
    assert all(r.token_ids == expected for r in survivors)
