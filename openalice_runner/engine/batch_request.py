"""A request in the batching scheduler: its sequence, its events to the caller, and where its
admission and prefill stand."""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field

from openalice_runner.engine.sequence import Sequence
from openalice_runner.engine.types import StreamEvent


@dataclass
class BatchRequest:
    seq: Sequence
    cancel: threading.Event
    events: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    thread: threading.Thread | None = None  # the scheduler thread that owes the answer
    admit_faults: int = 0  # admissions of it that failed
    prefilled: int = 0  # prompt tokens whose keys and values are in the cache
    reserved: int = 0  # cache positions it may ever need (slots.reservation), set at admission
    prefill_started: float = 0.0
    first_token_at: float = 0.0  # when the prefill chose the first token (FirstTokenTimes.first_decode_s)
    first_text: bool = False  # that token's text went out at once (no first decode in its time to first text)

    @property
    def prefilling(self) -> bool:
        return self.prefilled < len(self.seq.prompt)

    def gamma_now(self, batch: int, waiting: int) -> int:
        if self.seq.drafter is None:
            return 0
        table = self.seq.spec.per_batch
        if table is None or self.seq.fixed_draft_length:
            return self.seq.spec.gamma
        # waiting requests join the batch within a step or two: γ for the batch they make
        return table.at(batch + waiting)

    def note_first_text(self, prefill: bool, event: StreamEvent | None) -> None:
        """Note whether the first token's text went out with it; where it did not, the first decode
        round (the wait for its step and its pass) is part of the time to the first text."""
        if prefill:
            self.first_text = event is not None and bool(event.text)
        elif not self.first_text and self.seq.stats.target_passes == 1:
            self.seq.stats.first_token.first_decode_s = time.perf_counter() - self.first_token_at
