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

KV-cache budget (`kv_cache_bytes`): the cache is one rectangle, slots x positions, and grows as
requests write. Each admitted request reserves the positions it may ever need (its prompt, its
whole `max_tokens` reply and a round of drafts, within its context); a waiting request is admitted
only if the cache, with the slot it takes and positions for the longest reservation, stays within
the budget, so the lazy growth while replies are written never passes it. Otherwise it waits, and
the requests behind it wait too (first come, first served), until running requests finish. When
nothing runs, the cache first drops what the held histories keep beyond the budget; a request
whose reservation alone is over the budget then runs on its own.
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
from dataclasses import dataclass, field

import torch

from openalice_runner.engine.choice import choose_token
from openalice_runner.engine.cost_model import PassCostModel
from openalice_runner.engine.drafters.base import observed_rows, taps_for
from openalice_runner.engine.generator import PREFILL_CHUNK
from openalice_runner.engine.llama import LlamaModel
from openalice_runner.engine.prefixes import HeldPrefixes
from openalice_runner.engine.round import Round, plan_round, round_rows
from openalice_runner.engine.sequence import Sequence, accept_tokens, begin, emit, final_event, preview_forced
from openalice_runner.engine.settle import settle_round
from openalice_runner.engine.tree import TreeMask, plain_rows, tree_rows
from openalice_runner.engine.types import EngineOverloaded, SchedulerStopped, StreamEvent

logger = logging.getLogger(__name__)

DEFAULT_PREFILL_CHUNK = 128  # prompt tokens per step while other sequences decode
CACHE_GRANULE = 512  # KV caches grow in steps of this many positions
IDLE_SHRINK_S = 30.0  # idle this long, the KV cache gives back what the held histories do not need
ADMIT_TRIES = 3  # a request whose admission fails this many times is answered with the fault
# Chaos testing (docs/testing.md): this share of admissions fails as a passing fault would (a float, 0..1)
ADMISSION_FAULTS_ENV = "OPENALICE_INJECT_ADMISSION_FAULTS"
WATCH_S = 1.0  # a caller waiting on its events checks this often that the scheduler thread still runs


@dataclass
class BatchRequest:
    seq: Sequence
    cancel: threading.Event
    events: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    thread: threading.Thread | None = None  # the scheduler thread that owes the answer
    admit_faults: int = 0  # admissions of it that failed
    prefilled: int = 0  # prompt tokens whose keys and values are in the cache
    reserved: int = 0  # cache positions it may ever need (`_reservation`), set at admission
    prefill_started: float = 0.0

    @property
    def prefilling(self) -> bool:
        return self.prefilled < len(self.seq.prompt)

    def gamma_now(self, batch: int, waiting: int) -> int:
        if self.seq.drafter is None:
            return 0
        table = self.seq.spec.gamma_by_batch
        if table is None or self.seq.fixed_draft_length:
            return self.seq.spec.gamma
        # waiting requests join the batch within a step or two: γ for the batch they make
        return table.at(batch + waiting)


@dataclass
class _Rows:
    """What one sequence feeds in a step, and where its rows sit in the pass."""

    request: BatchRequest
    first: int
    count: int
    start: int  # the cache position of its first row
    logits_at: int  # its first row of the pass's logits (where it has any)
    choosing: int  # its last rows that choose a token (all of a round's; one or none of a prompt chunk's)
    round: Round | None = None  # None: a prefill chunk


@dataclass
class _StepRows:
    """The rows of a step's one pass, in order, and the plans they belong to."""

    vocab: int  # token ids a row may hold: below this
    plans: list[_Rows] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    logit_rows: list[int] = field(default_factory=list)  # rows that choose a token: only theirs are computed

    def add(self, request: BatchRequest, fed: list[int], start: int, choosing: int,
            planned: Round | None = None) -> None:
        """`fed` tokens of `request` at cache positions from `start`; the last `choosing` rows choose."""
        _check_rows(request.seq, fed, start, self.vocab)
        first, n = len(self.tokens), len(fed)
        self.plans.append(_Rows(request, first, n, start, len(self.logit_rows), choosing, planned))
        self.logit_rows += range(first + n - choosing, first + n)
        self.tokens += fed
        self.positions += range(start, start + n)
        self.slots += [request.seq.slot] * n

    def subset(self, plans: list[_Rows]) -> _StepRows:
        """The rows of `plans` alone, as a pass of their own."""
        rows = _StepRows(self.vocab)
        for plan in plans:
            rows.add(plan.request, self.tokens[plan.first : plan.first + plan.count], plan.start, plan.choosing,
                     plan.round)
        return rows


@dataclass
class _PassOut:
    """What the step's pass gives the sequences settling on it."""

    hidden: torch.Tensor
    tapped: torch.Tensor | None
    taps: tuple[int, ...]
    logits: torch.Tensor | None
    pass_s: float


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
        self.cache = model.new_cache(0, CACHE_GRANULE)
        self._waiting: deque[BatchRequest] = deque()
        self._running: list[BatchRequest] = []
        self._free_slots: list[int] = []  # least recently freed first
        self.prefix_reuse = prefix_reuse
        self.prefixes = HeldPrefixes()  # the free slots' histories (prefix reuse)
        self._cond = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None
        self.idle_shrink_s = idle_shrink_s
        self.kv_cache_bytes = kv_cache_bytes
        self.steps = 0
        self.admission_faults = _fault_rate(os.environ.get(ADMISSION_FAULTS_ENV))
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
        self.cache = self.model.new_cache(0, CACHE_GRANULE)
        self._free_slots = []
        self.prefixes.clear()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._closed and not self._waiting and not self._running:
                    timeout = self.idle_shrink_s if self._shrinkable() else None
                    if not self._cond.wait(timeout) and not (self._closed or self._waiting):
                        self._shrink()
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
            reserved = _reservation(request.seq)
            slots = self._slots_for(reserved)
            if slots is None and self._make_room(reserved):
                slots = self._slots_for(reserved)
            if slots is None:
                if self._running:
                    break  # over the budget: it waits for running requests, and later ones wait behind it
                # alone and over the budget on its own: it runs (its context bounds it), in a slot of its own
                slots = self.cache.batch if self._free_slots else self.cache.batch + 1
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
        if self.admission_faults and self._faults.random() < self.admission_faults:
            raise InjectedFault("an admission fault injected for a test (OPENALICE_INJECT_ADMISSION_FAULTS)")
        # positions for the prompt and a round; the reply's grow as it is written (`_reserve`): sizing
        # every slot for max_tokens up front held GBs for replies that stop after a few tokens
        need = _granules(_positions_for(seq, len(seq.prompt)))
        batch = self.cache.batch
        self.cache.grow(slots, need)
        self._free_slots += range(batch, self.cache.batch)
        seq.cache = self.cache
        free, held = list(self._free_slots), dict(self.prefixes.slots)
        try:
            seq.slot, reused = self._take_slot(seq)
        except BaseException:
            self._free_slots, self.prefixes.slots = free, held
            raise
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

    def _slots_for(self, reserved: int) -> int | None:
        """The cache's slots once a request that may need `reserved` positions is admitted, or None
        where the budget cannot take it now. Without a free slot the cache grows by doubling (few
        reallocations, and no memory for slots never used), as far as the budget allows."""
        grows = not self._free_slots
        least = self.cache.batch + grows
        most = min(self.max_batch, max(1, 2 * self.cache.batch)) if grows else self.cache.batch
        if self.kv_cache_bytes is None:
            return most
        # every slot may come to hold the longest reservation: the cache is a rectangle
        positions = max(self.cache.max_len, reserved, *(r.reserved for r in self._running))
        fitting = self.kv_cache_bytes // (positions * self.cache.position_bytes)
        return min(most, fitting) if fitting >= least else None

    def _make_room(self, reserved: int) -> bool:
        """Shrink the cache towards what the running requests and one that may need `reserved`
        positions need, dropping (or shortening) held histories, where that lets the request in
        or where nothing runs; whether the cache changed."""
        if self.kv_cache_bytes is None:
            return False
        positions = max([reserved, *(r.reserved for r in self._running)])  # each running slot writes below its own
        in_use = 1 + max((r.seq.slot for r in self._running), default=-1)
        fitting = self.kv_cache_bytes // (positions * self.cache.position_bytes)
        # alone, one slot stays whatever the budget: the request needs it, and it may hold its prefix
        slots = min(self.cache.batch, max(in_use, fitting, 0 if self._running else 1))
        if self._running:
            free_below = any(slot < slots for slot in self._free_slots)
            if slots + (not free_below) > fitting:
                return False  # shrinking would drop histories and still not let it in
        if slots >= self.cache.batch and positions >= self.cache.max_len:
            return False
        before = self.cache.nbytes()
        self.cache.shrink(slots, positions)
        self._free_slots = [slot for slot in self._free_slots if slot < slots]
        self.prefixes.cut(slots, self.cache.max_len)
        logger.debug("KV cache budget: %d -> %d bytes", before, self.cache.nbytes())
        return True

    def _kept_shape(self) -> tuple[int, int]:
        """(slots, positions) the held histories need."""
        slots = 1 + max(self.prefixes.slots, default=-1)
        longest = max((len(held.tokens) for held in self.prefixes.slots.values()), default=0)
        return slots, max(CACHE_GRANULE, -(-longest // CACHE_GRANULE) * CACHE_GRANULE)

    def _shrinkable(self) -> bool:
        if self.idle_shrink_s is None:
            return False
        slots, positions = self._kept_shape()
        return self.cache.batch > slots or self.cache.max_len > positions

    def _shrink(self) -> None:
        """Give back the cache memory of an idle engine, keeping the held histories (called by
        the scheduler thread, with nothing running)."""
        slots, positions = self._kept_shape()
        before = self.cache.nbytes()
        self.cache.shrink(slots, positions)
        self._free_slots = [slot for slot in self._free_slots if slot < slots]
        logger.debug("idle: KV cache %d -> %d bytes", before, self.cache.nbytes())

    def _take_slot(self, seq: Sequence) -> tuple[int, int]:
        """A free slot for `seq`, and how many of its prompt tokens the slot already holds.

        The slot with the longest usable prefix wins; without one, a slot that holds nothing,
        else the one freed longest ago, so recent histories stay for the calls that follow them."""
        best, reused = self.prefixes.best(self._free_slots, seq) if self.prefix_reuse else (None, 0)
        if best is None:
            empty = [slot for slot in self._free_slots if slot not in self.prefixes.slots]
            best = empty[0] if empty else self._free_slots[0]
        self._free_slots.remove(best)
        return best, self.prefixes.take(best, seq, reused)

    def _reserve(self) -> None:
        """Grow the cache's positions, a granule at a time, to what this step may write: every decoding
        sequence's tokens and a round of drafts (prefills fit since admission)."""
        need = max((_positions_for(r.seq, len(r.seq.tokens)) for r in self._running if not r.prefilling), default=0)
        if need > self.cache.max_len:
            self.cache.grow(self.cache.batch, _granules(need))

    def _step(self) -> None:
        """One step: plan every running sequence's rows, run them in one pass, settle each."""
        self._reserve()
        rows = self._plan()
        if rows.plans:
            self._run(rows)

    def _run(self, rows: _StepRows) -> None:
        """Run and settle a pass. Where the shared pass fails, it is split in halves and each run again
        until the fault is pinned to one sequence, which fails alone: the others settle on rows that
        are the same tokens at the same positions (a pass only writes its rows' cache entries, so a
        rerun writes the same ones), to the same replies as without the fault."""
        try:
            out = self._pass(rows)
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

    def _plan(self) -> _StepRows:
        """Every running sequence's rows for this step: a prompt chunk within the step's prefill budget,
        or the last token and its drafts; cancelled sequences leave, a fault in one's planning fails it."""
        rows = _StepRows(self.model.vocab_size)
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
    def _plan_prefill(rows: _StepRows, request: BatchRequest, budget: int) -> int:
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
    def _plan_decode(rows: _StepRows, request: BatchRequest, gamma: int, decoders: int, unplanned: int) -> None:
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

    def _pass(self, rows: _StepRows) -> _PassOut:
        """The step's one forward pass over every planned row, and the logits of the rows that choose."""
        plans = rows.plans
        tree = _tree_mask(plans)
        t0 = time.perf_counter()
        taps = taps_for(plan.request.seq.drafter for plan in plans)
        # only eagle-3 drafters ask for taps, and tree drafters for a mask: other models need not know
        extra = {} if tree is None else {"tree": tree}
        spans = [(plan.first, plan.first + plan.count) for plan in plans if plan.round is None]
        if spans and getattr(self.model, "prefill_bf16", False):  # prompt rows in bf16; decode rows keep their bits
            extra["prompt_spans"] = spans
        feed = torch.tensor(rows.tokens)
        if taps:
            hidden, tapped = self.model.forward_rows(feed, self.cache, rows.slots, rows.positions, taps, **extra)
        else:
            hidden, tapped = self.model.forward_rows(feed, self.cache, rows.slots, rows.positions, **extra), None
        # logits only where a token is chosen: every decode row, the last row of a finished prefill
        logits = self.model.logits(hidden[rows.logit_rows]) if rows.logit_rows else None
        pass_s = time.perf_counter() - t0
        self.steps += 1
        if self.costs is not None and all(plan.round is not None for plan in plans):
            # decode-only steps: what drafters weigh a longer draft against (prefill rows would
            # make a step of few decode rows look dear)
            self.costs.record(len(rows.tokens), pass_s, context=max(rows.positions) + 1)
        return _PassOut(hidden, tapped, taps, logits, pass_s)

    def _settle(self, plans: list[_Rows], out: _PassOut) -> None:
        """Each sequence settles on its own rows; a fault in one fails that sequence only."""
        for plan in plans:
            try:
                self._settle_one(plan, out)
            except Exception as exc:
                self._fail_one(plan.request, exc)

    def _settle_one(self, plan: _Rows, out: _PassOut) -> None:
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
        if event is not None:
            request.events.put(event)
        if seq.finished:
            self._retire(request)

    @staticmethod
    def _settle_prefill(plan: _Rows, rows: torch.Tensor, logits: torch.Tensor | None) -> list[int] | None:
        """A prompt chunk is in the cache; once the prompt is, its last row chooses the first token
        (the tokens emitted; None while the prompt is not all in)."""
        request, seq = plan.request, plan.request.seq
        request.prefilled += plan.count
        seq.cache.lengths[seq.slot] = request.prefilled
        if seq.drafter is not None and seq.drafter.wants_hidden:
            seq.drafter.observe(rows)
        if request.prefilling:
            return None
        first = choose_token(logits[plan.logits_at], seq)
        # the invariant of generator.py holds: `first` is emitted but not yet fed
        seq.stats.prefill_s = time.perf_counter() - request.prefill_started
        seq.stats.ttft_s = time.perf_counter() - seq.started
        return accept_tokens(seq, [first])

    def _retire(self, request: BatchRequest) -> None:
        seq = request.seq
        self._running.remove(request)
        self._free_slots.append(seq.slot)
        if self.prefix_reuse:
            self.prefixes.hold(seq, self.cache.lengths[seq.slot])
        request.events.put(final_event(seq))

    def _fail_one(self, request: BatchRequest, exc: BaseException, logged: bool = False) -> None:
        """`request` failed by a fault of ours: it leaves (its slot holds nothing: a pass may have
        written part of its rows) and its caller gets the error; the others run on."""
        if not logged:
            logger.error("engine: a sequence failed; the others run on", exc_info=exc)
        if request in self._running:
            self._running.remove(request)
            self._free_slots.append(request.seq.slot)
        request.events.put(exc)

    def _fail_running(self, exc: BaseException) -> None:
        for request in list(self._running):
            self._running.remove(request)
            self._free_slots.append(request.seq.slot)  # a pass failed mid-write: hold nothing
            request.events.put(exc)

    def _fail_all(self, exc: BaseException) -> None:
        self._fail_running(exc)
        while self._waiting:
            self._waiting.popleft().events.put(exc)


class InjectedFault(RuntimeError):
    """A fault injected on purpose (ADMISSION_FAULTS_ENV), to test that nothing is lost."""


def _fault_rate(raw: str | None) -> float:
    if not raw:
        return 0.0
    try:
        rate = float(raw)
    except ValueError:
        raise ValueError(f"{ADMISSION_FAULTS_ENV} must be a number in 0..1, got {raw!r}") from None
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"{ADMISSION_FAULTS_ENV} must be in 0..1, got {rate}")
    return rate


def _check_rows(seq: Sequence, fed: list[int], start: int, vocab: int) -> None:
    """A sequence's rows, checked before they join a shared pass: a row the pass cannot take would
    fail every sequence in it. Raises (failing this sequence alone) where one is out of range."""
    cache = seq.cache
    if not 0 <= seq.slot < cache.batch:
        raise ValueError(f"slot {seq.slot} is not one of the cache's {cache.batch}")
    if start < 0 or start + len(fed) > cache.max_len:
        raise ValueError(f"rows at positions {start}..{start + len(fed) - 1} are beyond the cache of {cache.max_len}")
    bad = [t for t in fed if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"token ids {bad[:4]} are outside the vocabulary of {vocab}")


def _positions_for(seq: Sequence, tokens: int) -> int:
    """Cache positions a sequence of `tokens` tokens needs for its next round (its drafts and the token
    before them), within its context."""
    rows = round_rows(seq.spec, seq.constraint is not None) + 2
    return min(tokens, seq.context_length) + rows


def _reservation(seq: Sequence) -> int:
    """Cache positions a sequence may ever need, in granules: its prompt and whole reply, and a round."""
    return _granules(_positions_for(seq, len(seq.prompt) + seq.sampling.max_tokens))


def _granules(positions: int) -> int:
    return -(-positions // CACHE_GRANULE) * CACHE_GRANULE


def _tree_mask(plans: list[_Rows]) -> TreeMask | None:
    """The pass's mask where a draft tree is in it (every row gets an entry), else None."""
    if all(plan.round is None or plan.round.proposal.parents is None for plan in plans):
        return None
    rows: list[tuple[int, int, int]] = []
    for plan in plans:
        if plan.round is None or plan.round.proposal.parents is None:  # a chain, or a prompt chunk
            rows += plain_rows(plan.start, plan.count)
        else:
            rows += tree_rows(plan.start, plan.round.proposal.parents)
    return TreeMask.from_rows(rows)


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
