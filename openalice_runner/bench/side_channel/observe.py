"""One streamed call as a network observer sees it: the server's writes, each a byte count and an
arrival time. Over TLS the bytes are hidden but each write's record size and timing are not, which
is all the fingerprinting attacks of arXiv 2411.01076 and 2511.03675 use.

On loopback the client's reads may join several writes, so the writes are told apart in the bytes:
with `pass` each SSE event is one write (one chunk, one Chat event); a padded mode begins every
write with an SSE comment block (server/release/padding.py), so a write is a comment block and the
events after it. A write's time is when the read that completed it arrived."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Observation:
    label: int  # which prompt was sent (the classifier's answer key)
    mode: str  # the stream release mode of the server
    method: str  # the speculation method the policy chose
    temperature: float
    reads: list[tuple[float, int]] = field(default_factory=list)  # writes: (seconds since the request, bytes)
    head: float = 0.0  # seconds from the request to the response's status line and headers
    text: str = ""  # what the model wrote (kept to check that modes change no output)
    finish_reason: str | None = None
    speculation: dict[str, Any] | None = None  # as the reply stated it (figures the release hides)

    @property
    def sizes(self) -> list[int]:
        return [n for _, n in self.reads]

    @property
    def gaps(self) -> list[float]:
        times = [t for t, _ in self.reads]
        return [b - a for a, b in zip(times, times[1:], strict=False)]


def observe(client, url: str, body: dict[str, Any], headers: dict[str, str], obs: Observation) -> Observation:
    """Stream BODY to URL's Chat Completions route, recording each read as it arrives. The text and
    finish reason are parsed afterwards from what was read (the observer does not need them)."""
    raw = bytearray()
    blocks: list[tuple[float, bytes]] = []  # each SSE block (event or comment) and when it was whole
    t0 = time.perf_counter()
    with client.stream("POST", f"{url}/chat/completions", json=body, headers=headers) as response:
        obs.head = time.perf_counter() - t0  # the headers cross the network too: a write of their own
        if response.status_code != 200:
            response.read()
            raise RuntimeError(f"{url}: HTTP {response.status_code}: {response.text[:300]}")
        pending = b""
        for piece in response.iter_raw():
            now = time.perf_counter() - t0
            raw += piece
            pending += piece
            *whole, pending = pending.split(b"\n\n")
            blocks += [(now, block + b"\n\n") for block in whole]
    obs.reads = writes(blocks)
    text: list[str] = []
    for line in raw.decode().splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[6:])
        obs.speculation = event.get("speculation") or obs.speculation
        for choice in event.get("choices") or []:
            text.append((choice.get("delta") or {}).get("content") or "")
            obs.finish_reason = choice.get("finish_reason") or obs.finish_reason
    obs.text = "".join(text)
    return obs


def writes(blocks: list[tuple[float, bytes]]) -> list[tuple[float, int]]:
    """The server's writes from its SSE blocks: with comment blocks in the stream (a padded mode),
    each starts a write that the events after it join; without, each event is a write."""
    padded = any(block.startswith(b":") for _, block in blocks)
    out: list[tuple[float, int]] = []
    for t, block in blocks:
        if padded and not block.startswith(b":") and out:
            out[-1] = (t, out[-1][1] + len(block))
        else:
            out.append((t, len(block)))
    return out
