"""Every write of a padded stream (fixed:N, paced) grows to a size bucket, so its size says nothing
of the tokens in it.

The padding is one SSE comment line at the start of the write: `:` and spaces, then a newline. The
SSE standard has every parser ignore a line that begins with a colon (servers send them as
keep-alives), and the clients in use do: the openai and anthropic SDKs (Python and TypeScript, so
Claude Code and Codex's TS tools), eventsource-parser (the Vercel AI SDK), Rust's eventsource-stream
(Codex). JSON whitespace inside a `data:` line would also parse, but a client that compares a data
line as a string (`data: [DONE]`) would not see it, and the Messages and Responses wires send events
the comment pads as well as any.

Buckets: the powers of two from 1 KiB (1024, 2048, 4096, ...): a write is padded to the smallest
that holds it and the comment line. A write of N tokens is far below 1 KiB on every wire (a Chat
chunk is ~200 bytes and its text), so the writes between the first and the end all weigh 1 KiB; the
first (the wire's opening events) and the end (usage; on Responses the whole response) fall where
their size puts them, and say what they always say: a stream began, and about how long it was."""

from __future__ import annotations

MIN_BUCKET = 1024


def bucket(size: int) -> int:
    """The smallest bucket of at least `size` bytes."""
    return max(MIN_BUCKET, 1 << (size - 1).bit_length())


def padded(data: bytes) -> bytes:
    """`data` (whole SSE events) after a comment line that brings the write to its bucket's size."""
    size = bucket(len(data) + 2)  # ":\n", the shortest comment line
    return b":" + b" " * (size - len(data) - 2) + b"\n" + data
