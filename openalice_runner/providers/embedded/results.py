"""A finished local generation as the provider's reply: the plain call's ChatResult, and the stream's
chunks (its calls as they are written, then its last chunk), both reporting the same usage,
speculation and finish reason.

The engine's results and stats (engine/types.py) are read by attribute (only providers/local.py
imports the engine): `result` has text, finish_reason and stats; `event` text and result."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any, Literal

from openalice_runner.first_token import FirstTokenBreakdown
from openalice_runner.providers.base import CallContext
from openalice_runner.providers.embedded import tool_format
from openalice_runner.providers.embedded.prompt import Prompt
from openalice_runner.providers.embedded.tool_stream import ToolCallStream
from openalice_runner.types import (
    ChatChunk,
    ChatResult,
    ChunkChoice,
    SpeculationInfo,
    ToolCall,
    Usage,
    new_id,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Finished:
    """What a plain reply and a stream's last chunk both report of a finished generation."""

    outcome: Any
    usage: Usage
    speculation: SpeculationInfo

    @classmethod
    def of(cls, result: Any, prompt: Prompt, ctx: CallContext, held_s: float | None = None) -> Finished:
        """`held_s`: a stream's time from the first token's arrival to its first chunk with content."""
        stats = result.stats
        stamp(stats, ctx)
        outcome = replace(stats.outcome(), first_token=first_token(stats, prompt, ctx, held_s))
        usage = Usage.of(stats.prompt_tokens or len(prompt.ids), stats.completion_tokens, stats.cached_prompt_tokens)
        return cls(outcome=outcome, usage=usage, speculation=speculation(outcome, stats))


def first_token(stats: Any, prompt: Prompt, ctx: CallContext, held_s: float | None = None) -> FirstTokenBreakdown:
    """The call's time before its first token by part: the server's parse, the prompt's building, the
    engine's `FirstTokenTimes` (an engine stood in by a test may have none) and a stream's held-back
    time (`held_s`, less the first decode round the engine counted)."""
    parts: dict[str, float | None] = {"parse": ctx.parse_s, **prompt.times}
    engine = getattr(stats, "first_token", None)
    first_decode = None if engine is None else engine.first_decode_s
    if held_s is not None:
        parts["held_back"] = max(0.0, held_s - (first_decode or 0.0))
    if engine is None:
        return FirstTokenBreakdown.of(parts)
    parts.update(queue=engine.queue_s, prefix_match=engine.prefix_match_s, prefill=engine.prefill_s,
                 first_token=engine.first_token_s, first_decode=first_decode)
    return FirstTokenBreakdown.of(parts, engine.chunks)


def reply(result: Any, prompt: Prompt, ctx: CallContext, *, model: str, provider: str) -> ChatResult:
    """The plain call's reply to `prompt` from the engine's `result`."""
    done = Finished.of(result, prompt, ctx)
    content, tool_calls = split(prompt, result.text, cut=budget_ended(result))
    out = ChatResult.single(
        model=model,
        content=content,
        tool_calls=tool_calls,
        finish_reason=finish(result, bool(tool_calls)),
        usage=done.usage,
        speculation=done.speculation,
        provider=provider,
    )
    return out.attach_outcome(done.outcome).with_stop(getattr(result, "stop", None)).with_budget(prompt.budget)


class StreamedReply:
    """A stream's chunks from the engine's events (`feed`), then, once it ended, its held pieces and
    last chunk (`end`). Calls stream as they are written where the grammar guarantees their form."""

    def __init__(self, prompt: Prompt, *, model: str, provider: str) -> None:
        self.prompt = prompt
        self.chunk_id, self.model, self.provider = new_id("chatcmpl"), model, provider
        self.calls = ToolCallStream(prompt.prefill, prompt.tool_names, incremental=prompt.grammar is not None)
        self.started = False  # a chunk went out (an engine failure now breaks the stream)
        self.result: Any = None
        # when the first token arrived, and then the first chunk with content went out (first_token.py)
        self._first_token_at: float | None = None
        self._held_s: float | None = None

    def feed(self, event: Any) -> Iterator[ChatChunk]:
        if event.result is not None:
            self.result = event.result
        if self._first_token_at is None and event.token_ids:
            self._first_token_at = time.perf_counter()
        for piece in self.calls.feed(event.text) if event.text else ():
            chunk = ChatChunk.piece(self.chunk_id, self.model, piece.content, piece.tool_calls, first=not self.started)
            self._mark_first_chunk()
            yield chunk.with_budget(self.prompt.budget)
            self.started = True

    def _mark_first_chunk(self) -> None:
        if not self.started and self._first_token_at is not None:
            self._held_s = time.perf_counter() - self._first_token_at

    def end(self, ctx: CallContext) -> Iterator[ChatChunk]:
        result = self.result
        assert result is not None, "engine stream ended without a result"
        end = self.calls.finish(budget_ended=budget_ended(result))
        if end.pieces:  # the first chunk may be one held to the end
            self._mark_first_chunk()
        done = Finished.of(result, self.prompt, ctx, self._held_s)
        for piece in end.pieces:
            chunk = ChatChunk.piece(self.chunk_id, self.model, piece.content, piece.tool_calls, first=not self.started)
            yield chunk.with_budget(self.prompt.budget)
            self.started = True
        final = ChatChunk(
            id=self.chunk_id,
            model=self.model,
            choices=[ChunkChoice(finish_reason=finish(result, bool(end.calls) and not end.cut))],
            usage=done.usage,
            speculation=done.speculation,
            provider=self.provider,
        )
        yield (final.attach_outcome(done.outcome).with_stop(getattr(result, "stop", None))
               .with_budget(self.prompt.budget))


def split(prompt: Prompt, text: str, *, cut: bool) -> tuple[str | None, list[ToolCall] | None]:
    """The reply's content and tool calls (`cut`: the budget ended it)."""
    if prompt.tool_names is None:
        return text, None
    parsed = tool_format.parse_tool_calls(prompt.prefill + text, prompt.tool_names)
    if parsed.malformed and cut and prompt.grammar is not None:
        # under a grammar a call block is well formed; one that is not was cut where closing did
        # not fit (finish_reason "length"): dropped, never raw markup as content
        logger.info("reply cut inside %d tool call(s); dropped", len(parsed.malformed))
        return tool_format.without_blocks(parsed), parsed.tool_calls or None
    if parsed.malformed:
        logger.info("model wrote %d malformed tool call(s); returned as content", len(parsed.malformed))
    return parsed.content, parsed.tool_calls or None


def speculation(outcome: Any, stats: Any) -> SpeculationInfo:
    info = SpeculationInfo.from_outcome(outcome)
    info.closing = getattr(stats, "closing", 0) or None
    return info


def finish(result: Any, calls: bool) -> Literal["stop", "length", "tool_calls"]:
    """A reply the budget ended (its structure closed to fit, or cut) says "length", its calls
    returned all the same; else "tool_calls" where it called, else the engine's reason."""
    if budget_ended(result):
        return "length"
    return "tool_calls" if calls else finish_reason(result.finish_reason)


def budget_ended(result: Any) -> bool:
    return result.finish_reason in ("length", "context_length") or bool(getattr(result.stats, "closing", 0))


def finish_reason(engine_finish: str) -> Literal["stop", "length"]:
    return "length" if engine_finish in ("length", "context_length") else "stop"


def stamp(stats: Any, ctx: CallContext) -> None:
    """The policy's rule and version on the engine's stats (its outcome reports them)."""
    plan = ctx.plan
    if plan is not None:
        stats.rule = plan.rule
        stats.policy_version = plan.policy_version
