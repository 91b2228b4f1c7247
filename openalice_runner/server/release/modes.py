"""The stream release modes and the one place a request's mode is decided.

    pass      one event per engine or upstream chunk (one target pass): the lowest latency; its rhythm
              and sizes show how many tokens each pass accepted
    fixed:N   N tokens an event (the last shorter only at the end), every write padded to a size bucket
    paced     one token an event; padded as fixed:N
              both leave on the clock of the tenant's recent decode rate (clocked.py); the first stream
              of a tenant, model and turn type, with no recent rate, as produced (fixed:N) or on its own measured
              rate, never more than one pass behind (paced.py)
    +pad      (fixed:N+pad, paced+pad) filler writes after the reply up to the request's max_tokens,
              so the count of writes and the end time do not tell the reply's length

A request's mode is its tenant's where the keys file gives one, else `serve --stream-release`
(server/tenants/tenant.py, `request_settings`). Imported by the CLI at start-up: nothing heavy here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

ReleaseKind = Literal["pass", "fixed", "paced"]
MAX_FIXED_N = 256  # more tokens an event is a buffered reply, not a stream
PAD = "+pad"  # fixed:N+pad, paced+pad: the reply's length padded (clocked.py)
USAGE = f"pass, fixed:N (N a whole number from 1 to {MAX_FIXED_N}) or paced, the last two optionally with {PAD}"


@dataclass(frozen=True)
class ReleaseMode:
    kind: ReleaseKind = "pass"
    n: int = 1  # tokens an event (fixed:N)
    pad_length: bool = False  # `+pad`: filler writes up to the request's max_tokens (clocked.py)

    @property
    def padded(self) -> bool:
        return self.kind != "pass"

    def __str__(self) -> str:
        name = f"fixed:{self.n}" if self.kind == "fixed" else self.kind
        return name + PAD if self.pad_length else name


PASS = ReleaseMode()


def parse_release(text: Any) -> ReleaseMode:
    """`pass`, `fixed:N` or `paced` as a ReleaseMode; anything else: ValueError saying what is allowed."""
    if isinstance(text, ReleaseMode):
        return text
    value = text.strip() if isinstance(text, str) else text
    if value == "pass":
        return PASS
    pad = isinstance(value, str) and value.endswith(PAD)
    if pad:
        value = value.removesuffix(PAD)
    if value == "paced":
        return ReleaseMode("paced", pad_length=pad)
    if isinstance(value, str) and value.startswith("fixed:"):
        digits = value.removeprefix("fixed:")
        if digits.isascii() and digits.isdigit() and 1 <= int(digits) <= MAX_FIXED_N:
            return ReleaseMode("fixed", int(digits), pad_length=pad)
    raise ValueError(f"expected {USAGE}, got {str(text)[:40]!r}")
