"""Re-writes one JSON object as it streams in, canonically: the text `json.dumps(json.loads(raw),
ensure_ascii=False)` would give, piece by piece.

A streamed tool call's `arguments` must join up to exactly what the unstreamed reply carries, and
that is the parsed object dumped again (tool_format.py). The grammar already writes json.dumps's
separators and string escapes, but not its numbers (`1.50`, `1e5`, `-0` are allowed) nor every
escape (`\\u001F`); so strings are decoded and re-encoded as they come, and a number or literal
goes out once it ends. The one difference left: an object that repeats a key comes out with both,
where parsing keeps the last (JSON readers on the client side do the same with the joined text).

The object's closing brace is held back (`closed`, `done`): the caller sends it once it knows the
value is really over (a tool call's closing `}`), so the joined pieces parse only when complete.
"""

from __future__ import annotations

import json

_WHITESPACE = " \t\n\r"
_SCALAR_END = ",]}" + _WHITESPACE


class JSONStreamError(ValueError):
    """The text is not (the beginning of) one JSON object."""


class CanonicalJSON:
    """Feed raw text of one JSON object; get canonical text back as soon as it is final."""

    def __init__(self) -> None:
        self._stack: list[str] = []  # "{" or "[" per open container
        self._expect = "value"  # value | key | colon | next (a comma or the container's end)
        self._first = False  # the open container has no member yet (its end may come at once)
        self._string: list[str] | None = None  # raw text of the string being read (None: not in one)
        self._escaped = False
        self._is_key = False
        self._scalar = ""  # a number or literal being read
        self.done = False  # the object is complete; its closing brace not sent yet

    def feed(self, text: str) -> tuple[str, str]:
        """(canonical text now final, the part of `text` after the object's end: not consumed)."""
        out: list[str] = []
        for i, ch in enumerate(text):
            if self.done:
                return "".join(out), text[i:]
            self._char(ch, out)
        if self._string is not None:
            out.append(self._decoded(final=False))
        return "".join(out), ""

    # ---- one character ----

    def _char(self, ch: str, out: list[str]) -> None:
        if self._string is not None:
            self._in_string(ch, out)
            return
        if self._scalar:
            if ch not in _SCALAR_END:
                self._scalar += ch
                return
            out.append(_canonical_scalar(self._scalar))
            self._scalar = ""
            self._after_value()
        if ch in _WHITESPACE:
            return
        if not self._stack and self._expect == "value" and ch != "{":
            raise JSONStreamError(f"expected an object, got {ch!r}")
        expect = self._expect
        if ch in "}]" and (expect == "next" or (self._first and expect in ("key", "value"))):
            self._close(ch, out)
        elif expect == "value":
            self._value_start(ch, out)
        elif expect == "key" and ch == '"':
            self._open_string(is_key=True, out=out)
        elif expect == "colon" and ch == ":":
            out.append(": ")
            self._expect = "value"
        elif expect == "next" and ch == ",":
            out.append(", ")
            self._expect = "key" if self._stack[-1] == "{" else "value"
        else:
            raise JSONStreamError(f"unexpected {ch!r} where a {expect} goes")

    def _close(self, ch: str, out: list[str]) -> None:
        if not self._stack or self._stack[-1] != ("{" if ch == "}" else "["):
            raise JSONStreamError(f"unexpected {ch!r}")
        self._stack.pop()
        if not self._stack:
            self.done = True  # the closing brace is the caller's to send
            return
        out.append(ch)
        self._first = False
        self._after_value()

    def _value_start(self, ch: str, out: list[str]) -> None:
        if ch in "{[":
            out.append(ch)
            self._stack.append(ch)
            self._expect, self._first = ("key" if ch == "{" else "value"), True
        elif ch == '"':
            self._open_string(is_key=False, out=out)
        elif ch in "-0123456789tfnNI":
            self._scalar = ch
        else:
            raise JSONStreamError(f"unexpected {ch!r} where a value goes")

    def _open_string(self, *, is_key: bool, out: list[str]) -> None:
        out.append('"')
        self._string, self._escaped, self._is_key = [], False, is_key
        self._first = False

    def _in_string(self, ch: str, out: list[str]) -> None:
        if self._escaped:
            self._escaped = False
        elif ch == "\\":
            self._escaped = True
        elif ch == '"':
            out.append(self._decoded(final=True))
            out.append('"')
            self._string = None
            if self._is_key:
                self._expect = "colon"
            else:
                self._after_value()
            return
        assert self._string is not None
        self._string.append(ch)

    def _after_value(self) -> None:
        self._expect, self._first = "next", False

    def _decoded(self, final: bool) -> str:
        """The string's raw text read so far, up to where it can be decoded on its own, re-encoded."""
        assert self._string is not None
        raw = "".join(self._string)
        cut = len(raw) if final else _safe_cut(raw)
        if cut == 0:
            return ""
        try:
            value = json.loads('"' + raw[:cut] + '"')
        except json.JSONDecodeError as exc:
            raise JSONStreamError(f"bad string: {exc.msg}") from None
        self._string = [raw[cut:]] if cut < len(raw) else []
        return json.dumps(value, ensure_ascii=False)[1:-1]


def _safe_cut(raw: str) -> int:
    """Length of the longest prefix of a string's raw text that decodes alone: it ends between
    escapes, and never between a `\\uD8xx` escape and the `\\uDCxx` that would pair with it."""
    i = cut = 0
    while i < len(raw):
        if raw[i] != "\\":
            i += 1
        elif raw.startswith("\\u", i):
            if i + 6 > len(raw):
                break
            high = "d800" <= raw[i + 2 : i + 6].lower() <= "dbff"
            i += 6
            if high:
                partner = raw[i : i + 6]
                if len(partner) < 6 and "\\u".startswith(partner[:2]):
                    break  # what follows may still be its low surrogate
                if partner.startswith("\\u") and "dc00" <= partner[2:].lower() <= "dfff":
                    i += 6
        elif i + 2 > len(raw):
            break
        else:
            i += 2
        cut = i
    return cut


def _canonical_scalar(text: str) -> str:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        raise JSONStreamError(f"bad literal {text!r}") from None
    if isinstance(value, (dict, list, str)):
        raise JSONStreamError(f"bad literal {text!r}")
    return json.dumps(value)
