"""Where a model call's time before its first token went (issue 49): named parts, in the order they run.

Provider-neutral (no engine, no torch): the local provider maps its own prompt-building times and the
engine's figures (engine/types.py `FirstTokenTimes`) into a `FirstTokenBreakdown`; the model-call span
carries it (tracing/telemetry.py) and so does the reply's `speculation.first_token` (bench-loops reads it).
The parts do not overlap, so their sum is at most the time to the first token; what they leave out
(HTTP, the policy, hops between threads, the scheduler's own work) is the rest.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

# parse: the server reading and validating the body; template: the chat template rendering the
# messages; tokenize: their text to token ids; history_align: the ids matched to the tokens the
# conversation's last call left (prefix reuse); grammar: the reply's grammar built or found;
# queue: waiting for a batch slot; prefix_match: finding the slot with the longest cached prefix;
# prefill: the prompt's passes (each one in `chunks`); first_token: choosing it from their logits;
# first_decode: the first decode round, where the first token's text was empty; held_back (streams):
# from the first token's arrival to the first chunk with content, less first_decode (a tool call's text
# is held until the call's name is known: the decode rounds until then)
PARTS = ("parse", "template", "tokenize", "history_align", "grammar", "queue", "prefix_match", "prefill",
         "first_token", "first_decode", "held_back")


@dataclass(frozen=True, slots=True)
class FirstTokenBreakdown:
    parts: tuple[tuple[str, float], ...]  # (part, seconds) in PARTS order: the parts measured
    chunks: tuple[tuple[int, float], ...] = ()  # each prefill pass: (prompt tokens, seconds)

    @classmethod
    def of(cls, parts: Mapping[str, float | None], chunks: Iterable[Iterable[float]] = ()) -> FirstTokenBreakdown:
        """From part -> seconds (None: not measured, left out); a name outside PARTS is a fault of ours."""
        unknown = set(parts) - set(PARTS)
        if unknown:
            raise ValueError(f"unknown first-token parts {sorted(unknown)}; known: {PARTS}")
        kept = tuple((name, float(parts[name])) for name in PARTS if parts.get(name) is not None)
        return cls(kept, tuple((int(tokens), float(seconds)) for tokens, seconds in chunks))

    @property
    def total_s(self) -> float:
        return sum(seconds for _, seconds in self.parts)

    def seconds(self, part: str) -> float | None:
        return dict(self.parts).get(part)

    @property
    def prefill_tokens(self) -> int:
        return sum(tokens for tokens, _ in self.chunks)

    def as_json(self) -> dict[str, Any]:
        """Milliseconds: {"parts_ms": {part: ms}, "total_ms": ms, "prefill_chunks": [[tokens, ms], ...]}."""
        return {
            "parts_ms": {name: round(1000 * s, 3) for name, s in self.parts},
            "total_ms": round(1000 * self.total_s, 3),
            "prefill_chunks": [[tokens, round(1000 * s, 3)] for tokens, s in self.chunks],
        }
