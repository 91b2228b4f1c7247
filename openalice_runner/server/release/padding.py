"""Every write of a padded stream (fixed:N, paced) grows to a size bucket, so its size says nothing
of the tokens in it.

The padding is an SSE comment at the start of the write, an event block of its own: `:`, spaces,
and the blank line that ends the block. The SSE standard has every parser ignore a line that begins
with a colon (servers send them as keep-alives), and a block with no data dispatches no event. The
clients in use read it so: the openai and anthropic Python SDKs (their SSEDecoder returns None for a
`:` line and for a block without data; tests/server/test_release.py streams through both), the
TypeScript SDKs (Claude Code) and eventsource-parser (the Vercel AI SDK) the same way, Rust's
eventsource-stream (Codex) per the standard. A block of its own, not a line inside the event's
block, so that a hand-written client that splits on blank lines and wants each block to begin with
`data:` skips the padding and keeps the event. JSON whitespace inside a `data:` line was the other
choice: a client that compares the line as a string (`data: [DONE]`) would miss it.

Buckets: the powers of two from 1 KiB (1024, 2048, 4096, ...): a write is padded to the smallest
that holds it and the comment. A write of a few tokens is far below 1 KiB on every wire (a Chat
chunk is ~200 bytes and its text), so the writes between the first and the end all weigh 1 KiB (a
large N, or text JSON escapes heavily, crosses into 2 KiB: still one of few sizes); the first (the wire's opening events) and the end (usage; on Responses the whole response) fall where
their size puts them, and say what they always say: a stream began, and about how long it was."""

from __future__ import annotations

MIN_BUCKET = 1024


def bucket(size: int) -> int:
    """The smallest bucket of at least `size` bytes."""
    return max(MIN_BUCKET, 1 << (size - 1).bit_length())


def padded(data: bytes) -> bytes:
    """`data` (whole SSE events) after a comment block that brings the write to its bucket's size."""
    size = bucket(len(data) + 3)  # ":\n\n", the shortest comment block
    return b":" + b" " * (size - len(data) - 3) + b"\n\n" + data
