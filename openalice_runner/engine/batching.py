"""Continuous batching: every running sequence shares each target pass.

One scheduler thread owns the model and a KV cache with one slot per running sequence. Each
step it admits waiting requests into free slots, asks every running sequence for its rows (a
chunk of prompt while it prefills; the last token plus its own γ drafts once it decodes, γ
chosen for this step from the batch size and the queue), runs one ragged forward pass over all
rows (`LlamaModel.forward_rows`), and settles each sequence on its own rows: exact
verification with its own sampler, its own accepted length, its own cache rollback. Finished
and cancelled sequences leave at once and free their slot for the next step.

Prefill is chunked: while others decode, a step feeds at most `prefill_chunk` prompt tokens,
so a long new prompt delays the running sequences by one chunk's cost per step, not by its
whole prefill.

Prefix reuse (`prefix_reuse`, prefixes.py): a finished sequence's slot keeps its keys and values
until the slot is needed; a new request of its tenant takes the free slot that holds the longest
prefix of its prompt and prefills only the rest.

KV-cache budget (`kv_cache_bytes`, slots.py): each admitted request reserves the positions it may
ever need; a waiting request is admitted only where the cache stays within the budget with it.

A step reads as schedule (`_plan`: every running sequence's rows, batch_pass.PassRows), run (one
pass, batch_pass.run_pass) and postprocess (`_settle`: each sequence on its own rows).
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import random
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterator

import torch

from openalice_runner.engine.batch_pass import PassOut, PassRows, SeqRows, run_pass
from openalice_runner.engine.batch_request import BatchRequest
from openalice_runner.engine.chaos import ADMISSION_FAULTS_ENV, InjectedFault, fault_rate
from openalice_runner.engine.choice import choose_token
from openalice_runner.engine.cost_model import PassCostModel
from openalice_runner.engine.drafters.base import observed_rows
from openalice_runner.engine.generator import PREFILL_CHUNK
from openalice_runner.engine.kv_cache import KVCache
from openalice_runner.engine.llama import LlamaModel
from openalice_runner.engine.round import plan_round
from openalice_runner.engine.sequence import Sequence, accept_tokens, begin, emit, final_event, preview_forced
from openalice_runner.engine.settle import settle_round
from openalice_runner.engine.slots import CacheSlots, granules, positions_for, reservation
from openalice_runner.engine.types import EngineOverloaded, SchedulerStopped, StreamEvent

logger = logging.getLogger(__name__)

DEFAULT_PREFILL_CHUNK = 128  # prompt tokens per step while other sequences decode
IDLE_SHRINK_S = 30.0  # idle this long, the KV cache gives back what the held histories do not need
ADMIT_TRIES = 3  # a request whose admission fails this many times is answered with the fault
WATCH_S = 1.0  # a caller waiting on its events checks this often that the scheduler thread still runs


class BatchScheduler:
    def __init__(
        self,
        model: LlamaModel,
        max_batch: int,
        costs: PassCostModel | None = None,
        prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
        max_waiting: int = 256,
        prefix_reuse: bool = False,
        idle_shrink_s: float | None = IDLE_SHRINK_S,
        kv_cache_bytes: int | None = None,
    ):
        """`idle_shrink_s`: after this long with nothing to do, the KV cache shrinks to the slots
        and positions that the histories kept for prefix reuse need (None: never).
        `kv_cache_bytes`: the most the KV cache may hold, enforced at admission (None: unbounded)."""
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if kv_cache_bytes is not None and kv_cache_bytes < 1:
            raise ValueError(f"kv_cache_bytes must be >= 1 or None, got {kv_cache_bytes}")
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        self.model = model
        self.max_batch = max_batch
        self.costs = costs
        self.prefill_chunk = prefill_chunk
        self.max_waiting = max_waiting
        self.slots = CacheSlots(model, max_batch, kv_cache_bytes)
        self.prefix_reuse = prefix_reuse  # (bench/follow_up.py switches it between runs)
        self._waiting: deque[BatchRequest] = deque()
        self._running: list[BatchRequest] = []
        self._cond = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None
        self.idle_shrink_s = idle_shrink_s
        self.steps = 0
        self.admission_faults = fault_rate(os.environ.get(ADMISSION_FAULTS_ENV))
        self._faults = random.Random(0)

    # ---- the callers' side ----------------------------------------------------------------
    def submit(
        self, seq: Sequence, cancel: threading.Event | None = None) -> BatchRequest:
        request = BatchRequest(seq, cancel or threading.Event())
        with self._cond:
            if self._closed:
                raise RuntimeError("the engine's scheduler is closed")
            if len(self._waiting) >= self.max_waiting:
                raise EngineOverloaded(f"{len(self._waiting)} requests already wait for a batch slot")
            begin(seq)
            self._waiting.append(request)
            if self._thread is None or not self._thread.is_alive():
                if self._thread is None:
                    atexit.register(_stop_at_exit, weakref.ref(self))
                self._thread = threading.Thread(target=self._serve, name="engine-batch", daemon=True)
                self._thread.start()
            request.thread = self._thread
            self._cond.notify()
        return request

    def events(self, request: BatchRequest) -> Iterator[StreamEvent]:
        """The request's stream; leaving it early cancels the request. Once cancelled, text the
        scheduler decoded ahead of a slow reader is dropped and the final event comes next.

        The wait is never unbounded: every `WATCH_S` it checks that the scheduler thread that owes
        the answer still runs, and raises `SchedulerStopped` where it does not."""
        try:
            while True:
                try:
                    item = request.events.get(timeout=WATCH_S)
                except queue.Empty:
                    self._check_alive(request)
                    continue
                if isinstance(item, BaseException):
                    raise item
                if item.result is None and request.cancel.is_set():
                    continue
                yield item
                if item.result is not None:
                    return
        finally:
            request.cancel.set()

    def _check_alive(self, request: BatchRequest) -> None:
        """Raise for a request whose answer can no longer come: its scheduler thread is gone."""
        thread = request.thread
        if thread is not None and not thread.is_alive() and request.events.empty():
            raise SchedulerStopped("the engine's scheduler thread stopped before answering this request")

    @property
    def load(self) -> tuple[int, int]:
        """(running, waiting)."""
        return len(self._running), len(self._waiting)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()

    @property
    def cache(self) -> KVCache:
        return self.slots.cache

    @property
    def kv_cache_bytes(self) -> int | None:
        return self.slots.kv_cache_bytes

    # ---- the scheduler thread -------------------------------------------------------------
    def _serve(self) -> None:
        """The thread's life: the loop, and should it ever end by an error that escaped it, every
        request it held answered and a fresh state for the thread the next `submit` starts."""
        try:
            self._loop()
        except BaseException as exc:
            logger.critical("engine scheduler thread died; its requests are answered", exc_info=exc)
            with self._cond:
                self._fail_all(SchedulerStopped(f"the engine's scheduler stopped: {exc!r}"))
                self._reset()

    def _reset(self) -> None:
        """A fresh, empty cache: nothing it held can be trusted after a fault outside the loop's care."""
        self.slots.reset()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._closed and not self._waiting and not self._running:
                    shrinkable = self.idle_shrink_s is not None and self.slots.shrinkable()
                    timeout = self.idle_shrink_s if shrinkable else None
                    if not self._cond.wait(timeout) and not (self._closed or self._waiting):
                        self.slots.shrink()
                if self._closed:
                    self._fail_all(RuntimeError("the engine's scheduler closed"))
                    return
                try:
                    self._admit()
                except Exception as exc:  # e.g. no memory for a grown cache: answer, never hang the callers
                    logger.exception("engine admission failed")
                    self._fail_all(exc)
                    continue
            try:
                self._step()
            except Exception as exc:  # a fault mid-pass: fail what ran in it, keep serving
                logger.exception("engine step failed")
                self._fail_running(exc)

    def _admit(self) -> None:
        self._drop_cancelled()
        while self._waiting and len(self._running) < self.max_batch:
            request = self._waiting[0]
            reserved = reservation(request.seq)
            slots = self.slots.fit(reserved, self._running)
            if slots is None and self.slots.make_room(reserved, self._running):
                slots = self.slots.fit(reserved, self._running)
            if slots is None:
                if self._running:
                    break  # over the budget: it waits for running requests, and later ones wait behind it
                # alone and over the budget on its own: it runs (its context bounds it), in a slot of its own
                slots = self.cache.batch if self.slots.free else self.cache.batch + 1
            self._waiting.popleft()
            try:
                self._place(request, reserved, slots)
            except Exception as exc:  # e.g. no memory for the grown cache: this request only, nothing else
                request.admit_faults += 1
                if request.admit_faults < ADMIT_TRIES:  # a passing fault: it keeps its place, tried next step
                    logger.warning("engine: admitting a request failed (%r); tried again", exc)
                    self._waiting.appendleft(request)
                    return
                logger.error("engine: admitting a request failed %d times; it is answered, the others run on",
                             request.admit_faults, exc_info=exc)
                request.events.put(exc)

    def _place(self, request: BatchRequest, reserved: int, slots: int) -> None:
        """Grow the cache to `slots` slots and put `request` in one, or raise leaving the scheduler as
        it was (the cache grows all or nothing; slots join the free list only once they exist)."""
        seq = request.seq
        admitted = time.perf_counter()
        if self.admission_faults and self._faults.random() < self.admission_faults:
            raise InjectedFault("an admission fault injected for a test (OPENALICE_INJECT_ADMISSION_FAULTS)")
        # positions for the prompt and a round; the reply's grow as it is written (`_reserve`): sizing
        # every slot for max_tokens up front held GBs for replies that stop after a few tokens
        self.slots.grow(slots, granules(positions_for(seq, len(seq.prompt))))
        seq.cache = self.cache
        t0 = time.perf_counter()
        seq.slot, reused = self._take_slot(seq)
        times = seq.stats.first_token
        times.queue_s, times.prefix_match_s = admitted - seq.started, time.perf_counter() - t0
        self.cache.lengths[seq.slot] = reused
        request.reserved = reserved
        request.prefilled = reused
        seq.stats.cached_prompt_tokens = reused
        request.prefill_started = time.perf_counter()
        self._running.append(request)

    def _drop_cancelled(self) -> None:
        """Answer the waiting requests whose callers left: they need not wait their turn for that."""
        for request in [r for r in self._waiting if r.cancel.is_set()]:
            self._waiting.remove(request)
            request.seq.finish_reason = "cancelled"
            request.events.put(final_event(request.seq))

    def _take_slot(self, seq: Sequence) -> tuple[int, int]:
        """A free slot for `seq`, and how many of its prompt tokens it already holds (CacheSlots.take)."""
        return self.slots.take(seq, self.prefix_reuse)

    def _step(self) -> None:
        """One step: plan every running sequence's rows, run them in one pass, settle each."""
        self.slots.reserve(self._running)
        rows = self._plan()
        if rows.plans:
            self._run(rows)

    def _run(self, rows: PassRows) -> None:
        """Run and settle a pass. Where the shared pass fails, it is split in halves and each run again
        until the fault is pinned to one sequence, which fails alone: the others settle on rows that
        are the same tokens at the same positions (a pass only writes its rows' cache entries, so a
        rerun writes the same ones), to the same replies as without the fault."""
        try:
            out = run_pass(self.model, self.cache, rows, self.costs)
            self.steps += 1
        except Exception as exc:
            if len(rows.plans) == 1:
                logger.error("engine pass failed; its sequence fails, the others run on", exc_info=exc)
                self._fail_one(rows.plans[0].request, exc, logged=True)
                return
            logger.warning("engine pass of %d sequences failed (%r); run again in halves", len(rows.plans), exc)
            half = len(rows.plans) // 2
            for part in (rows.plans[:half], rows.plans[half:]):
                self._run(rows.subset(part))
            return
        self._settle(rows.plans, out)

    def _plan(self) -> PassRows:
        """Every running sequence's rows for this step: a prompt chunk within the step's prefill budget,
        or the last token and its drafts; cancelled sequences leave, a fault in one's planning fails it."""
        rows = PassRows(self.model.vocab_size)
        batch, waiting = len(self._running), len(self._waiting)
        decoders = sum(not r.prefilling for r in self._running)
        budget = self.prefill_chunk if decoders else PREFILL_CHUNK
        unplanned = decoders  # decoding sequences the loop has not reached yet
        for request in list(self._running):
            unplanned -= not request.prefilling
            if request.cancel.is_set():
                request.seq.finish_reason = "cancelled"
                self._retire(request)
            elif request.prefilling:
                try:
                    budget -= self._plan_prefill(rows, request, budget)
                except Exception as exc:
                    self._fail_one(request, exc)
            else:
                try:  # a fault in one sequence's planning fails that sequence, not the batch
                    self._plan_decode(rows, request, request.gamma_now(batch, waiting), decoders, unplanned)
                except Exception as exc:
                    self._fail_one(request, exc)
        return rows

    @staticmethod
    def _plan_prefill(rows: PassRows, request: BatchRequest, budget: int) -> int:
        """A chunk of the prompt, at most `budget` tokens; how many it takes."""
        seq = request.seq
        n = min(budget, len(seq.prompt) - request.prefilled)
        if n <= 0:
            return 0
        # the last row of the chunk that ends the prompt chooses the reply's first token
        choosing = 1 if request.prefilled + n == len(seq.prompt) else 0
        rows.add(request, seq.prompt[request.prefilled : request.prefilled + n], request.prefilled, choosing)
        return n

    @staticmethod
    def _plan_decode(rows: PassRows, request: BatchRequest, gamma: int, decoders: int, unplanned: int) -> None:
        """The round's last token and drafts; forced tokens' text goes out before the pass."""
        seq = request.seq
        if seq.drafter is not None:
            # rows so far, plus one for this and each decoding sequence still to come
            seq.drafter.step_load(decoders, len(rows.tokens) + 1 + unplanned)
        planned = plan_round(seq, gamma)
        preview = preview_forced(seq, planned)  # certain tokens go out before the pass
        if preview is not None:
            request.events.put(preview)
        fed = [seq.tokens[-1], *planned.draft]
        rows.add(request, fed, planned.start, len(fed), planned)  # every row verifies

    def _settle(self, plans: list[SeqRows], out: PassOut) -> None:
        """Each sequence settles on its own rows; a fault in one fails that sequence only."""
        for plan in plans:
            if plan.round is None:  # a prompt chunk: its pass, whole, in the request's time to first token
                plan.request.seq.stats.first_token.chunks.append([plan.count, out.pass_s])
        for plan in plans:
            try:
                self._settle_one(plan, out)
            except Exception as exc:
                self._fail_one(plan.request, exc)

    def _settle_one(self, plan: SeqRows, out: PassOut) -> None:
        request, seq = plan.request, plan.request.seq
        rows = out.hidden[plan.first : plan.first + plan.count]
        if seq.drafter is not None and seq.drafter.feature_layers:
            rows = observed_rows(seq.drafter, rows, out.tapped[plan.first : plan.first + plan.count], out.taps)
        if plan.round is None:
            emitted = self._settle_prefill(plan, rows, out.logits)
            if emitted is None:
                return
        else:
            own = out.logits[plan.logits_at : plan.logits_at + plan.count]
            emitted = settle_round(seq, plan.round, own, rows, out.pass_s)
        event = emit(seq, emitted, plan.round)
        request.note_first_text(plan.round is None, event)
        if event is not None:
            request.events.put(event)
        if seq.finished:
            self._retire(request)

    @staticmethod
    def _settle_prefill(plan: SeqRows, rows: torch.Tensor, logits: torch.Tensor | None) -> list[int] | None:
        """A prompt chunk is in the cache; once the prompt is, its last row chooses the first token
        (the tokens emitted; None while the prompt is not all in)."""
        request, seq = plan.request, plan.request.seq
        request.prefilled += plan.count
        seq.cache.lengths[seq.slot] = request.prefilled
        if seq.drafter is not None and seq.drafter.wants_hidden:
            seq.drafter.observe(rows)
        if request.prefilling:
            return None
        t0 = time.perf_counter()
        first = choose_token(logits[plan.logits_at], seq)
        # the invariant of generator.py holds: `first` is emitted but not yet fed
        request.first_token_at = time.perf_counter()
        seq.stats.first_token.first_token_s = request.first_token_at - t0
        seq.stats.prefill_s = request.first_token_at - request.prefill_started
        seq.stats.ttft_s = request.first_token_at - seq.started
        return accept_tokens(seq, [first])

    def _retire(self, request: BatchRequest) -> None:
        seq = request.seq
        self._running.remove(request)
        self.slots.release(seq, hold=self.prefix_reuse)
        request.events.put(final_event(seq))

    def _fail_one(self, request: BatchRequest, exc: BaseException, logged: bool = False) -> None:
        """`request` failed by a fault of ours: it leaves (its slot holds nothing: a pass may have
        written part of its rows) and its caller gets the error; the others run on."""
        if not logged:
            logger.error("engine: a sequence failed; the others run on", exc_info=exc)
        if request in self._running:
            self._running.remove(request)
            self.slots.release(request.seq, hold=False)
        request.events.put(exc)

    def _fail_running(self, exc: BaseException) -> None:
        for request in list(self._running):
            self._running.remove(request)
            self.slots.release(request.seq, hold=False)  # a pass failed mid-write: hold nothing
            request.events.put(exc)

    def _fail_all(self, exc: BaseException) -> None:
        self._fail_running(exc)
        while self._waiting:
            self._waiting.popleft().events.put(exc)


def _stop_at_exit(ref: weakref.ref) -> None:
    """Let the scheduler thread finish its step and leave before the interpreter shuts down.

    A daemon thread still inside a torch call at shutdown is ended by forced unwinding through
    torch's C++ frames, and the process aborts ("terminate called without an active exception",
    exit status 134) after its work is done.
    """
    scheduler = ref()
    if scheduler is not None and scheduler._thread is not None:
        scheduler.close()
        scheduler._thread.join(timeout=30)
