"""The KV-cache budget of the batching scheduler (`kv_cache_bytes`, provider `kv_cache_mib`).

- Requests run together only as far as their reservations (prompt + max_tokens + a round, in
  granules, times the cache's slots) fit the budget; greedy output is the same as alone.
- The cache's bytes never pass the budget while long replies grow it.
- A lone request over the budget on its own still runs; the cache first sheds held histories.
- First come, first served: a big request that waits for room is not overtaken by small ones
  that arrive after it; waiting requests count toward the waiting line's limit (429).
- Bad settings are errors that name the field.
"""

from __future__ import annotations

import threading

import pytest
from pydantic import ValidationError

from openalice_runner.engine import Engine, SamplingParams, SpecConfig
from openalice_runner.engine.batching import BatchScheduler
from openalice_runner.engine.engine import DEFAULT_KV_CACHE_BYTES
from openalice_runner.engine.sequence import SequenceRequest, Target, new_sequence
from openalice_runner.engine.slots import CACHE_GRANULE
from openalice_runner.engine.types import EngineOverloaded
from openalice_runner.providers.local import EmbeddedConfig, EmbeddedProvider

OFF = SpecConfig(method="off")
WAIT_S = 120  # a shared CPU can be slow; a hang still fails


def _sequence(engine, scheduler, prompt, max_tokens, spec=OFF):
    # no EOS ids: every reply runs to max_tokens, so reservations are used in full
    drafter = None if spec.method == "off" else engine._make_drafter(spec, 2048, own_cache=True)
    return new_sequence(SequenceRequest(prompt, SamplingParams(max_tokens=max_tokens), spec, drafter),
                        Target(scheduler.cache, engine.tokenizer, frozenset(), engine.context_length), slot=-1)


def _submit_together(engine, scheduler, jobs):
    """Requests that all wait before the scheduler admits any (it admits under the same lock)."""
    with scheduler._cond:
        return [scheduler.submit(_sequence(engine, scheduler, *job)) for job in jobs]


def _drain(scheduler, request):
    return [e.result for e in scheduler.events(request) if e.result is not None][0]


def _alone(engine, prompt, max_tokens, spec=OFF) -> list[int]:
    scheduler = BatchScheduler(engine.model, max_batch=1)
    try:
        return _drain(scheduler, scheduler.submit(_sequence(engine, scheduler, prompt, max_tokens, spec))).token_ids
    finally:
        scheduler.close()


def _record_running(scheduler) -> list[int]:
    """How many requests ran in each step."""
    seen: list[int] = []
    step = scheduler._step

    def recording_step():
        seen.append(len(scheduler._running))
        step()

    scheduler._step = recording_step
    return seen


def test_requests_run_together_only_as_far_as_the_budget_holds_their_reservations(tiny_engine):
    """Three short requests, a budget for two reservations of one granule: never three at once,
    and each reply is the one it gets alone."""
    position = tiny_engine.model.new_cache(0, 1).position_bytes
    scheduler = BatchScheduler(tiny_engine.model, max_batch=4, kv_cache_bytes=2 * CACHE_GRANULE * position)
    seen = _record_running(scheduler)
    jobs = [
        (tiny_engine.encode("one two three one two three one two"), OFF),
        (tiny_engine.encode("def f(x):\n    return x"), SpecConfig(method="ngram", gamma=4)),
        (tiny_engine.encode("The quick brown fox jumps"), OFF),
    ]
    try:
        requests = _submit_together(tiny_engine, scheduler, [(p, 24, spec) for p, spec in jobs])
        got = [_drain(scheduler, r).token_ids for r in requests]
    finally:
        scheduler.close()
    assert max(seen) == 2  # two ran together; the third waited for one to finish
    assert scheduler.cache.batch == 2  # the doubling from 2 to 4 slots stopped at the budget
    assert got == [_alone(tiny_engine, p, 24, spec) for p, spec in jobs]


def test_the_cache_never_passes_the_budget_while_long_replies_grow_it(tiny_engine):
    position = tiny_engine.model.new_cache(0, 1).position_bytes
    budget = 5 * CACHE_GRANULE * position  # two slots of two granules, not three
    scheduler = BatchScheduler(tiny_engine.model, max_batch=4, kv_cache_bytes=budget)
    sizes: list[int] = []
    grow = scheduler.cache.grow

    def recording_grow(batch: int, max_len: int) -> None:
        grow(batch, max_len)
        sizes.append(scheduler.cache.nbytes())

    scheduler.cache.grow = recording_grow
    seen = _record_running(scheduler)
    prompts = [tiny_engine.encode(f"{word} " * 300)[:200] for word in ("alpha", "beta", "gamma", "delta")]
    try:
        requests = _submit_together(tiny_engine, scheduler, [(p, 400) for p in prompts])
        results = [_drain(scheduler, r) for r in requests]
    finally:
        scheduler.close()
    assert all(r.stats.completion_tokens == 400 for r in results)
    # 200 + 400 tokens reach the second granule; unbounded, four slots of it would be 4 * 1024 positions
    assert max(sizes) == 2 * 2 * CACHE_GRANULE * position <= budget
    assert max(seen) == 2


def test_a_lone_request_over_the_budget_runs_after_the_held_histories_make_room(tiny_engine):
    position = tiny_engine.model.new_cache(0, 1).position_bytes
    budget = 2 * CACHE_GRANULE * position
    scheduler = BatchScheduler(tiny_engine.model, max_batch=4, prefix_reuse=True, kv_cache_bytes=budget)
    big = tiny_engine.encode("word " * 1200)[:1000]  # 1000 + 64 tokens and a round: 3 granules, alone over budget
    try:
        small = _submit_together(tiny_engine, scheduler, [(tiny_engine.encode(t), 8) for t in ("hi", "yo")])
        for request in small:
            _drain(scheduler, request)
        assert scheduler.cache.batch == 2 and len(scheduler.slots.prefixes.slots) == 2  # two histories kept for reuse
        result = _drain(scheduler, scheduler.submit(_sequence(tiny_engine, scheduler, big, 64)))
        assert scheduler.cache.batch == 1  # the other slot's history went to make room
        assert set(scheduler.slots.prefixes.slots) | set(scheduler.slots.free) <= {0}  # drafters: held with them
        after = _drain(scheduler, scheduler.submit(_sequence(tiny_engine, scheduler, tiny_engine.encode("ok"), 8)))
    finally:
        scheduler.close()
    assert result.stats.completion_tokens == 64
    assert result.token_ids == _alone(tiny_engine, big, 64)
    assert after.stats.completion_tokens == 8


class GatedModel:
    """The tiny model, whose passes wait for the test's word: the test sees the scheduler between steps."""

    def __init__(self, model):
        self.model = model
        self.entered = threading.Semaphore(0)  # a pass has begun
        self.allowed = threading.Semaphore(0)  # a pass may go on
        self.open = threading.Event()  # every pass may go on

    def __getattr__(self, name):
        return getattr(self.model, name)

    def forward_rows(self, *args, **kwargs):
        self.entered.release()
        if not self.open.is_set():
            self.allowed.acquire()
        return self.model.forward_rows(*args, **kwargs)

    def next_pass(self) -> None:
        self.allowed.release()
        assert self.entered.acquire(timeout=WAIT_S)


def test_a_big_waiting_request_is_not_overtaken_by_small_ones_that_came_later(tiny_engine):
    """A small request runs; a big one cannot join it within the budget, so it waits; a small one
    that arrives after it would fit beside the first, but waits its turn behind the big one."""
    gate = GatedModel(tiny_engine.model)
    position = tiny_engine.model.new_cache(0, 1).position_bytes
    # one granule + two granules do not fit (two slots of two granules); two of one granule do
    scheduler = BatchScheduler(gate, max_batch=4, kv_cache_bytes=3 * CACHE_GRANULE * position)
    admitted: list[str] = []
    take_slot = scheduler._take_slot

    def recording_take_slot(seq):
        admitted.append(names[id(seq)])
        return take_slot(seq)

    scheduler._take_slot = recording_take_slot
    names: dict[int, str] = {}

    def submit(name, prompt, max_tokens):
        seq = _sequence(tiny_engine, scheduler, prompt, max_tokens)
        names[id(seq)] = name
        return scheduler.submit(seq)

    big_prompt = tiny_engine.encode("word " * 700)[:600]
    try:
        first = submit("first", tiny_engine.encode("hello there"), 300)
        assert gate.entered.acquire(timeout=WAIT_S)  # its first pass
        big = submit("big", big_prompt, 100)
        later = submit("later", tiny_engine.encode("a small one"), 8)
        gate.next_pass()  # admission ran between the passes
        assert scheduler.load == (1, 2)  # the big one waits for room, the later one behind it
        scheduler.max_waiting = 2
        with pytest.raises(EngineOverloaded):  # waiting for room counts toward the waiting line
            submit("refused", tiny_engine.encode("one more"), 8)
        first.cancel.set()
        gate.open.set()
        gate.allowed.release()
        results = {name: _drain(scheduler, request) for name, request in
                   (("first", first), ("big", big), ("later", later))}
    finally:
        gate.open.set()
        gate.allowed.release()
        scheduler.close()
    assert admitted == ["first", "big", "later"]
    assert results["first"].finish_reason == "cancelled"
    assert results["big"].stats.completion_tokens == 100 and results["later"].stats.completion_tokens == 8
    assert results["big"].token_ids == _alone(tiny_engine, big_prompt, 100)


def test_bad_budgets_are_errors_that_name_the_field(tiny_engine):
    with pytest.raises(ValidationError, match="kv_cache_mib"):
        EmbeddedConfig.model_validate({"type": "local", "kv_cache_mib": 8})
    with pytest.raises(ValueError, match="kv_cache_bytes"):
        BatchScheduler(tiny_engine.model, max_batch=2, kv_cache_bytes=0)
    with pytest.raises(ValueError, match="kv_cache_bytes"):
        Engine(tiny_engine.hf_model, tiny_engine.tokenizer, "tiny", "fp32", kv_cache_bytes=-1)


def test_the_provider_default_matches_the_engine_and_reaches_it():
    assert EmbeddedConfig(type="local").kv_cache_mib * 2**20 == DEFAULT_KV_CACHE_BYTES
    assert EmbeddedConfig(type="local", kv_cache_mib=None).kv_cache_mib is None  # unbounded, when asked for
    provider = EmbeddedProvider("local", EmbeddedConfig(type="local", tiny_random=True, kv_cache_mib=20))
    assert provider.engine.scheduler.kv_cache_bytes == 20 * 2**20
