"""Tool calls read out of the embedded engine's reply while it streams, as OpenAI-style deltas.

Plain text before a call streams as content (less whatever may be the start of `<tool_call>`).
From a call block on, two cases:

- **Incremental** (the reply is grammar-constrained, so a call block is a well-formed call of an
  offered tool, tool_format's layout: `<tool_call>\\n{"name": N, "arguments": A}\\n</tool_call>`,
  calls one per line): once `{"name": "N", "arguments": {` is out, a first delta with the call's
  index, id, type and name (arguments ""), then the arguments as they are written, re-written as
  the unstreamed reply has them (json_stream.py), so the pieces of an index join up to exactly its
  `arguments`. Their closing brace goes out with the call's own `}`: joined pieces parse only once
  the call is whole. What strays from the layout before a call's first delta (a stand-in engine, a
  future template) is held back and parsed at the end, as below.
- **Held back** (no grammar): from the first call block to the end, parsed when the reply is
  complete; a malformed call is content then, never a call half-streamed.

A reply cut inside a streamed call (max_tokens, a stop string) leaves that call's arguments
incomplete (`ToolStreamEnd.cut`): as with OpenAI, the finish reason says why it stopped.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from openalice_runner.providers.embedded import tool_format
from openalice_runner.providers.embedded.json_stream import CanonicalJSON, JSONStreamError
from openalice_runner.types import FunctionCallDelta, ToolCallDelta

_OPEN = tool_format.TOOL_CALL_OPEN
_NAME_KEY = '\n{"name": "'  # what follows the open tag, up to the tool's name
_ARGUMENTS_KEY = '", "arguments": {'  # after the name, up to the arguments' first brace
_CLOSE = "\n" + tool_format.TOOL_CALL_CLOSE
_NEXT = "\n" + _OPEN  # another call block


@dataclass
class StreamPiece:
    """What one chunk's delta carries."""

    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


@dataclass
class ToolStreamEnd:
    pieces: list[StreamPiece] = field(default_factory=list)  # what was still held
    calls: int = 0  # tool calls sent in all, complete ones
    cut: bool = False  # a streamed call's arguments stopped short


class ToolCallStream:
    """Feed the reply's text as it comes (`feed`), then `finish` once generation ended.

    `prefill`: assistant text the prompt already ends with (a forced call's opening), part of the
    reply; `tool_names`: the offered tools (None: nothing is parsed, all text is content);
    `incremental`: stream calls as they are written (only for grammar-constrained replies)."""

    def __init__(self, prefill: str, tool_names: set[str] | None, incremental: bool) -> None:
        self.names = tool_names
        self.incremental = incremental
        self._unfed = prefill  # goes out with the first text the model writes
        self._state = "text"  # text | opening | arguments | closing | between | held
        self._buf = ""  # text not placed yet (a possible tag, the call's opening, the tail held)
        self._calls = 0  # calls streamed and complete
        self._open: int | None = None  # index of the call whose arguments are streaming
        self._args: CanonicalJSON | None = None

    def feed(self, text: str) -> list[StreamPiece]:
        text, self._unfed = self._unfed + text, ""
        if self.names is None:
            return [StreamPiece(content=text)] if text else []
        out: list[StreamPiece] = []
        self._buf += text
        while self._step(out):
            pass
        return _merged(out)

    def finish(self, budget_ended: bool = False) -> ToolStreamEnd:
        """The stream's end; `budget_ended`: the reply's budget ended it, so under a grammar a
        held block that does not parse was cut there and is dropped (never raw markup as content)."""
        out = self.feed("") if self._unfed else []
        end = ToolStreamEnd(pieces=out, calls=self._calls, cut=self._open is not None)
        if self.names is None:
            return end
        state, rest = self._state, self._buf
        if state == "text" and rest:
            out.append(StreamPiece(content=rest))
        elif state == "between" and rest.strip():
            out.append(StreamPiece(content=rest.strip()))  # part of an open tag, cut (content when parsed)
        elif state in ("opening", "held"):
            parsed = tool_format.parse_tool_calls(rest, self.names)
            if self.incremental and budget_ended:  # grammar-constrained and cut: never content
                parsed.content = tool_format.without_blocks(parsed)
            first = self._calls + int(end.cut)  # after a call cut short: its index is taken
            deltas = [
                ToolCallDelta(
                    index=first + i, id=tc.id, type="function",
                    function=FunctionCallDelta(name=tc.function.name, arguments=tc.function.arguments),
                )
                for i, tc in enumerate(parsed.tool_calls)
            ]  # fmt: skip
            if parsed.content or deltas:
                out.append(StreamPiece(content=parsed.content or None, tool_calls=deltas or None))
            end.calls += len(deltas)
        self._buf = ""
        end.pieces = _merged(out)
        return end

    # ---- one step: place what the buffer allows; False when it must wait for more text ----

    def _step(self, out: list[StreamPiece]) -> bool:
        buf = self._buf
        if not buf:
            return False
        state = self._state
        if state == "text":
            at = buf.find(_OPEN)
            if at < 0:
                keep = tool_format.could_start_tool_call(buf)
                if len(buf) > keep:
                    out.append(StreamPiece(content=buf[: len(buf) - keep]))
                self._buf = buf[len(buf) - keep :]
                return False
            if at:
                out.append(StreamPiece(content=buf[:at]))
            self._buf = buf[at:]
            self._state = "opening" if self.incremental else "held"
            return True
        if state == "opening":
            return self._opening(out)
        if state == "arguments":
            return self._arguments(out)
        if state == "closing":  # after the call's `}`: its close tag
            return self._expect(_CLOSE, then="between", drop=len(_CLOSE))
        if state == "between":  # after a call block: the next one's open tag (calls one per line)
            return self._expect(_NEXT, then="opening", drop=1)
        return False  # held: everything waits for the end

    def _opening(self, out: list[StreamPiece]) -> bool:
        """`<tool_call>\\n{"name": "N", "arguments": {`, N an offered tool: the call's first delta."""
        head = self._buf[len(_OPEN) :]
        if len(head) < len(_NAME_KEY):
            return self._hold_unless(_NAME_KEY.startswith(head))
        if not head.startswith(_NAME_KEY):
            return self._hold()
        rest = head[len(_NAME_KEY) :]
        quote = rest.find('"')
        if quote < 0:
            assert self.names is not None
            return self._hold_unless(any(n.startswith(rest) for n in self.names))
        name, after = rest[:quote], rest[quote:]
        assert self.names is not None
        if name not in self.names or not _ARGUMENTS_KEY.startswith(after[: len(_ARGUMENTS_KEY)]):
            return self._hold()
        if len(after) < len(_ARGUMENTS_KEY):
            return False
        index = self._calls
        out.append(StreamPiece(tool_calls=[ToolCallDelta(
            index=index, id=tool_format.new_call_id(), type="function",
            function=FunctionCallDelta(name=name, arguments=""),
        )]))  # fmt: skip
        self._open, self._args = index, CanonicalJSON()
        self._state = "arguments"
        self._buf = "{" + after[len(_ARGUMENTS_KEY) :]
        return True

    def _arguments(self, out: list[StreamPiece]) -> bool:
        assert self._args is not None and self._open is not None
        if not self._args.done:
            try:
                text, rest = self._args.feed(self._buf)
            except JSONStreamError:  # not what the grammar writes: the call stops here
                self._state = "held"
                return False
            if text:
                out.append(_fragment(self._open, text))
            self._buf = rest
            if not self._args.done:
                return False
        if not self._buf:
            return False
        if self._buf[0] != "}":  # the call's own closing brace
            self._state = "held"
            return False
        out.append(_fragment(self._open, "}"))  # the arguments' brace, held until now
        self._calls += 1
        self._open, self._args = None, None
        self._state, self._buf = "closing", self._buf[1:]
        return True

    def _expect(self, text: str, then: str, drop: int) -> bool:
        """The buffer starts with `text`: drop its first `drop` characters and go on in state
        `then`; or it may still (wait); or it cannot (held: parsed at the end)."""
        buf = self._buf
        if buf.startswith(text):
            self._state, self._buf = then, buf[drop:]
            return True
        if not text.startswith(buf):
            self._state = "held"
        return False

    def _hold(self) -> bool:
        self._state = "held"
        return False

    def _hold_unless(self, fits: bool) -> bool:
        if not fits:
            self._state = "held"
        return False


def _fragment(index: int, arguments: str) -> StreamPiece:
    return StreamPiece(tool_calls=[ToolCallDelta(index=index, function=FunctionCallDelta(arguments=arguments))])


def _merged(pieces: list[StreamPiece]) -> list[StreamPiece]:
    """Consecutive pieces of the same kind as one (content with content, a call's fragments with
    the next fragments of the same call); a call's first delta stays a chunk of its own."""
    out: list[StreamPiece] = []
    for piece in pieces:
        last = out[-1] if out else None
        if last is not None and piece.content and last.content and not last.tool_calls and not piece.tool_calls:
            last.content += piece.content
        elif last is not None and _same_call_fragments(last, piece):
            assert last.tool_calls and piece.tool_calls
            fn, more = last.tool_calls[0].function, piece.tool_calls[0].function
            assert fn is not None and more is not None
            fn.arguments = (fn.arguments or "") + (more.arguments or "")
        else:
            out.append(piece)
    return out


def _same_call_fragments(a: StreamPiece, b: StreamPiece) -> bool:
    if a.content or b.content or not a.tool_calls or not b.tool_calls:
        return False
    if len(a.tool_calls) != 1 or len(b.tool_calls) != 1:
        return False
    x, y = a.tool_calls[0], b.tool_calls[0]
    return x.index == y.index and x.id is None and y.id is None
