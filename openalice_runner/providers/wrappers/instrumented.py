"""InstrumentedProvider: tracing added by wrapping a provider, not sprinkled through every provider.

Each chat() or stream() becomes one `chat {model}` CLIENT span, child of whatever span is current when
the call is made (the turn's `invoke_agent` span), plus the GenAI client metrics.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

from opentelemetry import context as otel_context

from openalice_runner.providers.base import OTEL_CONTEXT_KEY, CallContext
from openalice_runner.providers.streams import ChatStream, chat_stream
from openalice_runner.providers.wrappers.wrapper import WrapperProvider
from openalice_runner.tracing.chat_call import ChatCall
from openalice_runner.tracing.telemetry import RunnerTelemetry
from openalice_runner.types import ChatChunk, ChatRequest, ChatResult, Usage


class InstrumentedProvider(WrapperProvider):
    def __init__(self, wrapped: Any, telemetry: RunnerTelemetry) -> None:
        super().__init__(wrapped)
        self.telemetry = telemetry

    def _start(
        self, request: ChatRequest, ctx: CallContext, *, stream: bool, parent: otel_context.Context | None = None
    ) -> ChatCall:
        wrapped = self.wrapped
        call = self.telemetry.start_chat(
            model=request.model or ctx.model or wrapped.model_name,
            provider=wrapped.name,
            gen_ai_provider=wrapped.gen_ai_provider_name,
            turn_type=ctx.turn_type,
            conversation_id=ctx.conversation_id,
            step=ctx.step,
            agent=ctx.agent,
            plan=ctx.plan,
            request=request,
            stream=stream,
            parent=parent,
            tenant=ctx.tenant,
        )
        return call

    async def chat(self, request: Any, ctx: Any) -> Any:
        call = self._start(request, ctx, stream=False, parent=_parent_of(ctx))
        try:
            result = await self.wrapped.chat(request, ctx)
        except BaseException as exc:
            call.fail(exc)
            raise
        call.finish(**_result_fields(result))
        return result

    def stream(self, request: ChatRequest, ctx: CallContext) -> AbstractAsyncContextManager[ChatStream]:
        # The parent is taken now, at call time: the block may be entered later, in whatever context
        # opens it (e.g. the HTTP server's response task).
        return self._stream(request, ctx, _parent_of(ctx) or otel_context.get_current())

    @asynccontextmanager
    async def _stream(
        self, request: ChatRequest, ctx: CallContext, parent: otel_context.Context
    ) -> AsyncIterator[ChatStream]:
        call = self._start(request, ctx, stream=True, parent=parent)
        try:
            async with self.wrapped.stream(request, ctx) as chunks, chat_stream(_observed(call, chunks)) as out:
                yield out
        except BaseException as exc:  # the provider's error, or the caller's own from inside the block
            call.fail(exc)
            raise
        # Left before the last chunk: the consumer went away mid-stream (a no-op when the call finished).
        call.fail(GeneratorExit())


async def _observed(call: ChatCall, chunks: ChatStream) -> AsyncGenerator[ChatChunk, None]:
    fields: dict[str, Any] = {}
    async for chunk in chunks:
        if call.first_chunk_s is None and _chunk_has_content(chunk):
            call.first_chunk()
        _merge_chunk_fields(fields, chunk)
        yield chunk
    call.finish(**fields)


def _parent_of(ctx: CallContext) -> otel_context.Context | None:
    return ctx.attributes.get(OTEL_CONTEXT_KEY) if ctx.attributes else None


def _usage_tokens(usage: Usage | None) -> tuple[int | None, int | None, int | None]:
    """(input, output, cached input) tokens; None where unknown (left off the span, never 0)."""
    if usage is None:
        return None, None, None
    details = usage.prompt_tokens_details
    return usage.prompt_tokens, usage.completion_tokens, details.cached_tokens if details else None


def _result_fields(result: ChatResult) -> dict[str, Any]:
    input_tokens, output_tokens, cached_tokens = _usage_tokens(result.usage)
    return {
        "response_id": result.id,
        "response_model": result.model,
        "finish_reason": result.finish_reason,
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "cached_input_tokens": cached_tokens,
        "speculation": result.outcome,
        "output_message": result.message,
    }


def _chunk_has_content(chunk: ChatChunk) -> bool:
    return any(c.delta.content or c.delta.tool_calls for c in chunk.choices)


def _merge_chunk_fields(fields: dict[str, Any], chunk: ChatChunk) -> None:
    fields["response_id"] = chunk.id
    fields["response_model"] = chunk.model
    if (finish := chunk.finish_reason) is not None:
        fields["finish_reason"] = finish
    if chunk.outcome is not None:
        fields["speculation"] = chunk.outcome
    if chunk.usage is not None:
        fields["input_tokens"], fields["output_tokens"], fields["cached_input_tokens"] = _usage_tokens(chunk.usage)
