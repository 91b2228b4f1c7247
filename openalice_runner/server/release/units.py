"""What a token is where the re-chunking runs, and chunks cut into units and rebuilt from them.

The unified chunk stream carries text, not token ids: a pool's chunk holds whatever its engine step
produced, and the embedded engine's tool-call parser re-cuts its text. So a token here is a unit of
the text itself, cut as a BPE pre-tokenizer cuts words (GPT-2's rule: a word with its leading space,
a number of up to 3 digits, a run of punctuation, whitespace; runs capped at 16 letters and 4
punctuation or whitespace characters, as a vocabulary has no token for 24 newlines): about one model
token on English text and code, and the same for every provider. Where a unit ends is a function of the text alone, never
of where a pass ended: the last unit of what has arrived is held until the text after it (or the end
of its piece) shows it complete. A tool call's opening (its id and name) is one unit; its arguments
are cut as text. A chunk with nothing to cut (the last one: finish reason, usage, speculation) is a
marker of no units that keeps its place in the order.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from openalice_runner.types import ChatChunk, ChunkChoice, Delta, FunctionCallDelta, ToolCallDelta

# the last alternative takes any one character, so the units of a text always join back to it
UNIT = re.compile(r" ?[^\W\d_]{1,16}| ?\d{1,3}| ?[^\s\w]{1,4}|\s{1,4}(?!\S)|\s{1,4}|[\s\S]")


def cut(text: str) -> list[str]:
    """`text` in units (they join back to it)."""
    return UNIT.findall(text)


@dataclass(frozen=True)
class Atom:
    """One unit, or a marker (`units` 0). `call`: the tool call's index (None: content); `opening`:
    the call's first piece (id, type, name); `text`: the unit's text; `source`: the chunk it came from
    (id, model, budget of what is rebuilt; a marker's chunk itself)."""

    source: ChatChunk
    text: str = ""
    call: int | None = None
    opening: ToolCallDelta | None = None
    marker: bool = False

    @property
    def units(self) -> int:
        return 0 if self.marker else 1


class Cutter:
    """A stream's chunks in atoms, in order. Each piece of text (the content, each call's arguments)
    holds back its last unit until more of the same piece, another piece, a marker or the end."""

    def __init__(self) -> None:
        self.held: Atom | None = None  # the held back unit

    def feed(self, chunk: ChatChunk) -> list[Atom]:
        out: list[Atom] = []
        delta = chunk.delta
        if len(chunk.choices) != 1 or not (delta.content or delta.tool_calls):
            out += self.flush()
            out.append(Atom(chunk, marker=True))
            return out
        ends = chunk.finish_reason is not None or chunk.usage is not None or chunk.speculation is not None
        source = _emptied(chunk, ending=False) if ends else chunk  # its units carry none of the ending
        if delta.content:
            out += self._text(source, delta.content, None)
        for call in delta.tool_calls or ():
            function = call.function or FunctionCallDelta()
            if call.id or function.name:
                out += self.flush()
                opening = ToolCallDelta(index=call.index, id=call.id, type=call.type,
                                        function=FunctionCallDelta(name=function.name))  # fmt: skip
                out.append(Atom(source, call=call.index, opening=opening))
            if function.arguments:
                out += self._text(source, function.arguments, call.index)
        if ends:
            out += self.flush()  # what ends the stream keeps its place after the text
            out.append(Atom(_emptied(chunk, ending=True), marker=True))
        return out

    def flush(self) -> list[Atom]:
        held, self.held = self.held, None
        return [held] if held is not None else []

    def _text(self, chunk: ChatChunk, text: str, call: int | None) -> list[Atom]:
        out: list[Atom] = []
        held = self.held
        if held is not None and held.call == call and held.opening is None:
            text, self.held = held.text + text, None
        else:
            out += self.flush()
        units = cut(text)
        last = units.pop()
        out += [Atom(chunk, unit, call) for unit in units]
        self.held = Atom(chunk, last, call)
        return out


def _emptied(chunk: ChatChunk, *, ending: bool) -> ChatChunk:
    """`chunk` without its delta (`ending`: the marker that keeps its finish reason, usage and
    speculation), or without those (the source of its units)."""
    choice = chunk.choices[0]
    if ending:
        return chunk.model_copy(update={"choices": [ChunkChoice(index=choice.index, finish_reason=choice.finish_reason)]})
    return chunk.model_copy(update={"choices": [], "usage": None, "speculation": None})


class Builder:
    """Atoms back into chunks: one chunk per run of content or of one call's pieces, in order (a wire
    formats a chunk's content before its calls, so a run never mixes them); the stream's first chunk
    with a delta carries the assistant role, as the providers' do."""

    def __init__(self) -> None:
        self.started = False

    def build(self, atoms: list[Atom]) -> list[ChatChunk]:
        out: list[ChatChunk] = []
        run: list[Atom] = []
        for atom in atoms:
            if run and (atom.marker or atom.call != run[0].call or atom.opening is not None):
                out.append(self._chunk(run))
                run = []
            if atom.marker:
                out.append(atom.source)
            else:
                run.append(atom)
        if run:
            out.append(self._chunk(run))
        return out

    def _chunk(self, run: list[Atom]) -> ChatChunk:
        first = run[0]
        text = "".join(atom.text for atom in run)
        if first.call is None:
            delta = Delta(content=text)
        else:
            opening = first.opening
            function = FunctionCallDelta(name=opening.function.name if opening and opening.function else None,
                                         arguments=text or None)  # fmt: skip
            piece = ToolCallDelta(index=first.call, id=opening.id if opening else None,
                                  type=opening.type if opening else None, function=function)  # fmt: skip
            delta = Delta(tool_calls=[piece])
        if not self.started:
            delta.role, self.started = "assistant", True
        return first.source.model_copy(update={"choices": [ChunkChoice(delta=delta)]})
