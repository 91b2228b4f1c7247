"""The batching scheduler under faults: every caller answered, one bad sequence fails alone.

- Admission either places a request or leaves the scheduler as it was (no phantom slots), and the
  request taken off the queue is answered with the fault, never left waiting.
- A sequence's rows are checked before they join a shared pass (a draft token outside the vocabulary
  fails that sequence, not the pass).
- A shared pass that fails because of one sequence's rows is run again in halves until the fault is
  pinned to that sequence: the others finish with the tokens they have alone.
- A caller's wait is bounded: should the scheduler thread die, its requests are answered and the next
  request gets a fresh thread; a caller whose thread is gone without answering is told so.

Each test waits for its callers with a bound (`RESULT_S`), so a hang fails the test instead of hanging
the suite; nothing sleeps.
"""

from __future__ import annotations

import threading

import pytest

from openalice_runner.engine import Engine, SamplingParams, SpecConfig, batching
from openalice_runner.engine.types import SchedulerStopped

RESULT_S = 60  # far beyond any reply here: only a caller that waits forever reaches it
PROMPTS = ["The quick brown fox jumps over", "one two three four five one two", "def f(x):\n    return"]
MARK = 13  # max_tokens of the sequence a test faults
SPEC = SpecConfig(method="ngram", gamma=3)


class Injected(RuntimeError):
    """The fault a test injects."""


@pytest.fixture
def engine():
    return Engine.tiny_random(seed=0, max_batch=4)


def _generate(engine, prompt: str, max_tokens: int):
    return engine.generate(engine.encode(prompt), SamplingParams(max_tokens=max_tokens), SPEC)


def _alone(engine, lengths: list[int]) -> list[list[int]]:
    return [_generate(engine, p, n).token_ids for p, n in zip(PROMPTS, lengths, strict=True)]


def _together(engine, lengths: list[int]) -> list:
    """Each prompt at once; per prompt its result or the exception it raised. Fails (instead of
    hanging) where a caller gets no answer within RESULT_S."""
    start = threading.Barrier(len(lengths))

    def one(i: int):
        start.wait()
        return _generate(engine, PROMPTS[i], lengths[i])

    return _answered_all([lambda i=i: one(i) for i in range(len(lengths))])


def _answered_all(fns) -> list:
    """Each fn() in a daemon thread of its own, its result or the exception it raised, in order; fails
    where one gets no answer within RESULT_S (a daemon thread left waiting does not hold the process)."""
    box: list = [None] * len(fns)
    done = [threading.Event() for _ in fns]

    def run(i: int) -> None:
        try:
            box[i] = fns[i]()
        except BaseException as exc:  # noqa: BLE001 - the test looks at which it was
            box[i] = exc
        done[i].set()

    for i in range(len(fns)):
        threading.Thread(target=run, args=(i,), daemon=True).start()
    for event in done:
        assert event.wait(RESULT_S), "a caller was never answered"
    return box


def _answered(fn):
    return _answered_all([fn])[0]


def _consistent(scheduler) -> None:
    """No phantom slots: every free slot exists, none is both free and running."""
    running = {r.seq.slot for r in scheduler._running}
    assert all(0 <= slot < scheduler.cache.batch for slot in scheduler.slots.free)
    assert not running & set(scheduler.slots.free)
    assert len(set(scheduler.slots.free)) == len(scheduler.slots.free)


# ---------------------------------------------------------------- admission


@pytest.mark.parametrize("lasting", [False, True])
def test_a_cache_that_fails_to_grow_leaves_no_phantom_slots_and_the_request_is_answered(engine, monkeypatch,
                                                                                      lasting):
    """A passing fault: the request keeps its place and is admitted on a later try, exact. A lasting one:
    it is answered with the fault after ADMIT_TRIES tries. Either way the scheduler is as before."""
    scheduler = engine.scheduler
    expected = _alone(engine, [12, 12, 12])
    failed = []
    # a fresh scheduler state: admission must grow the cache by slots
    with scheduler._cond:
        scheduler._reset()
    cache = scheduler.cache
    real = cache.grow

    def grow(batch, max_len):
        if batch > cache.batch and (lasting or not failed):  # a grow by slots: a new request's admission
            failed.append(batch)
            raise MemoryError("no memory for a grown KV cache")
        return real(batch, max_len)

    monkeypatch.setattr(cache, "grow", grow)
    result = _answered(lambda: _generate(engine, PROMPTS[0], 12))
    _consistent(scheduler)
    if lasting:
        assert isinstance(result, MemoryError) and len(failed) == batching.ADMIT_TRIES
        assert cache.batch == 0 and scheduler.slots.free == []
        monkeypatch.setattr(cache, "grow", real)
    else:
        assert len(failed) == 1 and result.token_ids == expected[0]
    # the scheduler serves on, exact
    assert _answered(lambda: _alone(engine, [12, 12, 12])) == expected
    _consistent(scheduler)


def test_a_fault_while_taking_a_slot_fails_that_request_alone(engine, monkeypatch):
    scheduler = engine.scheduler
    expected = _alone(engine, [24, 24, 24])
    real = scheduler._take_slot
    hit = []

    def take_slot(seq):
        if seq.sampling.max_tokens == MARK:  # a lasting fault: every try
            hit.append(seq)
            raise Injected("taking a slot failed")
        return real(seq)

    monkeypatch.setattr(scheduler, "_take_slot", take_slot)
    out = _together(engine, [24, MARK, 24])
    assert len(hit) == batching.ADMIT_TRIES and isinstance(out[1], Injected)
    assert [out[0].token_ids, out[2].token_ids] == [expected[0], expected[2]]
    _consistent(scheduler)


def test_injected_admission_faults_are_tried_again_and_nothing_is_lost(monkeypatch):
    """The chaos knob the load test uses: every other admission fails; every request is served, exact."""
    monkeypatch.setenv(batching.ADMISSION_FAULTS_ENV, "0.5")
    engine = Engine.tiny_random(seed=0, max_batch=4)
    assert engine.scheduler.admission_faults == 0.5
    expected = _alone(Engine.tiny_random(seed=0, max_batch=4), [24, 24, 24])
    out = _together(engine, [24, 24, 24])
    assert [r.token_ids for r in out] == expected


def test_the_chaos_knob_refuses_what_is_not_a_share(monkeypatch):
    for raw in ["x", "1.5", "-0.1"]:
        monkeypatch.setenv(batching.ADMISSION_FAULTS_ENV, raw)
        with pytest.raises(ValueError, match=batching.ADMISSION_FAULTS_ENV):
            Engine.tiny_random(seed=0, max_batch=2)


# ---------------------------------------------------------------- one sequence's rows


def test_a_draft_token_outside_the_vocabulary_fails_its_sequence_not_the_pass(engine, monkeypatch):
    expected = _alone(engine, [24, 24, 24])
    vocab = engine.model.cfg.vocab_size
    real = batching.plan_round
    planned = {"bad": 0, "others": 0}

    def plan_round(seq, gamma):
        planned_round = real(seq, gamma)
        if seq.sampling.max_tokens == MARK:
            planned["bad"] += 1
            planned_round.draft = [*planned_round.draft, vocab + 5]
            return planned_round
        planned["others"] += 1
        return planned_round

    monkeypatch.setattr(batching, "plan_round", plan_round)
    out = _together(engine, [24, MARK, 24])
    assert planned["bad"] and planned["others"]
    assert isinstance(out[1], ValueError) and "outside the vocabulary" in str(out[1])
    assert [out[0].token_ids, out[2].token_ids] == [expected[0], expected[2]]


def test_a_pass_that_one_sequence_breaks_is_rerun_without_it_and_the_others_finish_exact(engine, monkeypatch):
    scheduler = engine.scheduler
    expected = _alone(engine, [24, 24, 24])
    real = engine.model.forward_rows
    faulted = {"passes": 0, "shared": 0}

    def forward_rows(tokens, cache, row_slot, row_pos, *args, **kwargs):
        bad = [r.seq.slot for r in scheduler._running if r.seq.sampling.max_tokens == MARK
               and not r.prefilling and len(r.seq.tokens) > len(r.seq.prompt) + 2]
        if bad and bad[0] in row_slot:
            faulted["passes"] += 1
            faulted["shared"] += len(set(row_slot)) > 1
            raise Injected("a row of one sequence broke the pass")
        return real(tokens, cache, row_slot, row_pos, *args, **kwargs)

    monkeypatch.setattr(engine.model, "forward_rows", forward_rows)
    out = _together(engine, [24, MARK, 24])
    assert faulted["shared"], "the faulting sequence shared a pass with others"
    assert isinstance(out[1], Injected)
    assert [out[0].token_ids, out[2].token_ids] == [expected[0], expected[2]]
    _consistent(scheduler)
    monkeypatch.setattr(engine.model, "forward_rows", real)
    assert _alone(engine, [24, 24, 24]) == expected


# ---------------------------------------------------------------- the thread's life


def test_a_scheduler_thread_that_dies_answers_its_requests_and_the_next_gets_a_fresh_one(engine, monkeypatch):
    scheduler = engine.scheduler
    expected = _alone(engine, [24, 24, 24])
    old_thread = scheduler._thread
    real, real_submit = scheduler._step, scheduler.submit
    died = []
    submitted, all_in = [], threading.Event()

    def submit(*args, **kwargs):
        request = real_submit(*args, **kwargs)
        submitted.append(request)
        if len(submitted) == 3:
            all_in.set()
        return request

    def step():
        # no step before all three are submitted: on a loaded machine the first could otherwise finish
        # before the others arrive, and the thread would die with one request where the test sends three
        assert all_in.wait(RESULT_S), "the three requests were not submitted"
        if not died and any(not r.prefilling for r in scheduler._running):
            died.append(True)
            raise SystemExit("not an Exception: escapes the loop's handlers")
        return real()

    monkeypatch.setattr(scheduler, "submit", submit)
    monkeypatch.setattr(scheduler, "_step", step)
    out = _together(engine, [24, 24, 24])
    assert died and all(isinstance(r, SchedulerStopped) for r in out), out
    old_thread.join(RESULT_S)
    assert not old_thread.is_alive()
    monkeypatch.setattr(scheduler, "submit", real_submit)
    assert _answered(lambda: _alone(engine, [24, 24, 24])) == expected
    assert scheduler._thread is not old_thread and scheduler._thread.is_alive()


def test_a_caller_whose_scheduler_thread_is_gone_without_answering_is_told(engine, monkeypatch):
    monkeypatch.setattr(batching, "WATCH_S", 0.01)
    gone = threading.Thread(target=lambda: None)
    gone.start()
    gone.join()
    request = batching.BatchRequest(seq=None, cancel=threading.Event(), thread=gone)
    result = _answered(lambda: list(engine.scheduler.events(request)))
    assert isinstance(result, SchedulerStopped)
    assert request.cancel.is_set()
