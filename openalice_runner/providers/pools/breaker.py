"""A replica's circuit breaker: a replica that gave no first token in time is suspect, and skipped
until a probe finds it answering again.

Closed, the replica serves. A call that times out on it before its first token (or whose stream
stalls after it) opens the breaker: the call moves on to the next replica and later calls skip this
one for `suspect_for_s`. Then it is half-open: one probe, a one-token request the runner sends
itself (never a client's request, which would wait the whole timeout again), goes to it; an answer
closes the breaker, a timeout or a 5xx opens it again for twice as long as before (up to
MAX_BACKOFF times the first cool-down). Without it a stalled server that still accepts connections
is chosen again and again, and every call through it waits the whole first-token timeout.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_BACKOFF = 32  # a replica that stays stalled is probed at most every 32 x suspect_for_s


@dataclass
class Breaker:
    suspect: bool = False  # open or half-open: calls skip the replica
    probe_at: float = 0.0  # when the next probe may go (the clock the provider keeps)
    failures: int = 0  # timeouts in a row: the one that opened it, then each failed probe
    probing: bool = False  # a probe is in flight
    why: str = ""  # what made it suspect, for the error a call gets when every replica is

    def open(self, now: float, cool_down_s: float, why: str) -> bool:
        """A call timed out on the replica. False where it was suspect already (a call that
        started before the breaker opened): the cool-down stays as it was."""
        if self.suspect:
            return False
        self.suspect, self.failures, self.probe_at, self.why = True, 1, now + cool_down_s, why
        return True

    def probe_due(self, now: float) -> bool:
        return self.suspect and not self.probing and now >= self.probe_at

    def probe_failed(self, now: float, cool_down_s: float, why: str) -> float:
        """The probe got no answer: open again, for longer. Returns the new cool-down."""
        self.failures += 1
        wait = cool_down_s * min(2 ** (self.failures - 1), MAX_BACKOFF)
        self.probe_at, self.why = now + wait, why
        return wait

    def close(self) -> None:
        self.suspect, self.failures, self.why = False, 0, ""
