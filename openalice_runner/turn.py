"""A turn of the agent loop: its model calls and tool steps, numbered and traced (`runner.turn(...)`)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from contextvars import Token
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeAlias

from openalice_runner.providers.base import OTEL_CONTEXT_KEY, CallContext
from openalice_runner.providers.streams import ChatStream
from openalice_runner.types import (
    ChatChunk,
    ChatMessage,
    ChatRequest,
    ChatResult,
    ToolDefinition,
    coerce_messages,
)

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.trace import Span
    from pydantic import BaseModel

    from openalice_runner.runner import Runner

# What the loop passes as messages, tools and tool_choice: OpenAI-shaped dicts or the models.
MessagesArg: TypeAlias = "ChatRequest | Sequence[ChatMessage | Mapping[str, Any]]"
ToolsArg: TypeAlias = "Sequence[ToolDefinition | Mapping[str, Any]] | None"
ToolChoiceArg: TypeAlias = "str | Mapping[str, Any] | None"
ResponseFormatArg: TypeAlias = "type[BaseModel] | Mapping[str, Any] | None"


def _response_format(value: ResponseFormatArg) -> dict[str, object]:
    """`response_format` as a ChatRequest field: a pydantic model class becomes its strict JSON schema."""
    if value is None:
        return {}
    from pydantic import BaseModel

    if isinstance(value, type) and issubclass(value, BaseModel):
        schema = {"name": value.__name__, "schema": value.model_json_schema(), "strict": True}
        value = {"type": "json_schema", "json_schema": schema}
    return {"response_format": value}


class Turn:
    """One turn of the agent: several model calls and tool steps, numbered in order (step 1, 2, ...).

    `attach_context`: make the turn span current inside `async with` (so the loop's own spans nest
    under it). SyncTurn turns it off: its calls run in different tasks, so parents are passed explicitly.
    """

    def __init__(
        self,
        runner: Runner,
        conversation_id: str | None,
        turn_type: str,
        agent: str | None,
        *,
        attach_context: bool = True,
    ) -> None:
        self.runner = runner
        self.conversation_id = conversation_id
        self.turn_type = turn_type
        self.agent = agent
        self.step = 0
        self._attach = attach_context
        self._span: Span | None = None
        self._otel_ctx: Context | None = None
        self._token: Token[Context] | None = None

    async def __aenter__(self) -> Turn:
        tel = self.runner.telemetry
        if tel is not None:
            from opentelemetry import context as otel_context
            from opentelemetry import trace

            self._span = tel.start_turn(self.agent, self.conversation_id, self.turn_type)
            self._otel_ctx = trace.set_span_in_context(self._span)
            if self._attach:
                self._token = otel_context.attach(self._otel_ctx)
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        tel = self.runner.telemetry
        if tel is None or self._span is None:
            return
        if self._token is not None:
            from opentelemetry import context as otel_context

            with contextlib.suppress(ValueError):  # exited in another context than entered
                otel_context.detach(self._token)
            self._token = None
        tel.end_turn(self._span, error=exc, steps=self.step)
        self._span = None

    def _next_ctx(self, turn_type: str | None, model: str | None) -> CallContext:
        self.step += 1
        attributes = {OTEL_CONTEXT_KEY: self._otel_ctx} if self._otel_ctx is not None else {}
        return CallContext(
            conversation_id=self.conversation_id,
            turn_type=turn_type or self.turn_type,
            step=self.step,
            agent=self.agent,
            model=model,
            attributes=attributes,
        )

    def _call(
        self,
        messages: MessagesArg,
        tools: ToolsArg,
        tool_choice: ToolChoiceArg,
        response_format: ResponseFormatArg,
        turn_type: str | None,
        model: str | None,
        sampling: dict[str, object],
    ) -> tuple[ChatRequest, CallContext]:
        """The request of one `chat` or `stream` call and its context (the turn's next step)."""
        sampling.update(_response_format(response_format))
        request = self._request(messages, tools, tool_choice, model, sampling)
        return request, self._next_ctx(turn_type, request.model)

    @staticmethod
    def _request(
        messages: MessagesArg, tools: ToolsArg, tool_choice: ToolChoiceArg, model: str | None,
        sampling: dict[str, object],
    ) -> ChatRequest:
        if isinstance(messages, ChatRequest):
            return messages
        fields = {"messages": coerce_messages(messages), "tools": tools, "tool_choice": tool_choice, "model": model}
        return ChatRequest.model_validate({**fields, **sampling})

    async def chat(
        self,
        messages: MessagesArg,
        *,
        tools: ToolsArg = None,
        tool_choice: ToolChoiceArg = None,
        response_format: ResponseFormatArg = None,
        turn_type: str | None = None,
        model: str | None = None,
        **sampling: object,
    ) -> ChatResult:
        """One model call. `messages`: dicts or ChatMessage (or a ready ChatRequest); `sampling`:
        temperature, top_p, top_k, seed, stop, max_tokens (and any other ChatRequest field, e.g.
        parallel_tool_calls). `response_format`: OpenAI's dict, or a pydantic model class (its JSON
        schema, strict); the embedded engine enforces it by grammar."""
        request, ctx = self._call(messages, tools, tool_choice, response_format, turn_type, model, sampling)
        return await self.runner.chat(request, ctx)

    def stream(
        self,
        messages: MessagesArg,
        *,
        tools: ToolsArg = None,
        tool_choice: ToolChoiceArg = None,
        response_format: ResponseFormatArg = None,
        turn_type: str | None = None,
        model: str | None = None,
        **sampling: object,
    ) -> AsyncGenerator[ChatChunk, None]:
        """One streamed model call; the last chunk carries finish_reason, usage and speculation.
        The generation stops when the iteration ends or fails, or when the generator is closed: to stop
        early, read it in `async with contextlib.aclosing(turn.stream(...))` (a bare `break` leaves the
        closing to the garbage collector); `runner.stream` gives the `async with` form directly."""
        request, ctx = self._call(messages, tools, tool_choice, response_format, turn_type, model, sampling)
        return _chunks_of(self.runner.stream(request, ctx))

    @contextlib.asynccontextmanager
    async def tool(
        self, name: str, call_id: str | None = None, arguments: object = None
    ) -> AsyncIterator[ToolStep]:
        """A tool step run by the loop: timed and traced as `execute_tool {name}`."""
        async with self._tool_step(name, call_id, arguments) as step:
            yield step

    @contextlib.asynccontextmanager
    async def _tool_step(self, name: str, call_id: str | None, arguments: object) -> AsyncIterator[ToolStep]:
        self.step += 1
        step = ToolStep(name, call_id, self.step)
        tel = self.runner.telemetry
        if tel is None:
            yield step
            return
        from opentelemetry import context as otel_context
        from opentelemetry import trace

        span = tel.start_tool(
            name, call_id, self.step, self.turn_type, parent=self._otel_ctx, arguments=arguments
        )
        token = otel_context.attach(trace.set_span_in_context(span)) if self._attach else None
        try:
            yield step
        except BaseException as exc:
            tel.end_tool(span, error=exc, result=step.result)
            raise
        else:
            tel.end_tool(span, result=step.result)
        finally:
            if token is not None:
                with contextlib.suppress(ValueError):
                    otel_context.detach(token)


async def _chunks_of(opened: AbstractAsyncContextManager[ChatStream]) -> AsyncGenerator[ChatChunk, None]:
    """A stream's context as a plain async iterator: closing the generator leaves the context."""
    async with opened as chunks:
        async for chunk in chunks:
            yield chunk


class ToolStep:
    """Handle given inside `turn.tool(...)`: set `.result` to record the tool's output."""

    def __init__(self, name: str, call_id: str | None, step: int) -> None:
        self.name = name
        self.call_id = call_id
        self.step = step
        self.result: object = None  # what the tool returned (traced where content is recorded)
