"""InstrumentedProvider: tracing added by wrapping a provider, not sprinkled through every provider.

Each chat() or stream() becomes one `chat {model}` CLIENT span, child of whatever span is current when
the call is made (the turn's `invoke_agent` span), plus the GenAI client metrics.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from opentelemetry import context as otel_context

from openalice_runner.providers.wrapper import WrapperProvider
from openalice_runner.tracing.telemetry import ChatCall, RunnerTelemetry, _first, _get

#: CallContext.attributes key under which a caller may pass the OpenTelemetry context to parent the call
#: span on (the sidecar does: its turn spans live across requests, not in the current context).
OTEL_CONTEXT_KEY = "otel_context"


class InstrumentedProvider(WrapperProvider):
    def __init__(self, wrapped: Any, telemetry: RunnerTelemetry) -> None:
        super().__init__(wrapped)
        self.telemetry = telemetry

    def _start(
        self, request: Any, ctx: Any, *, stream: bool, parent: otel_context.Context | None = None
    ) -> ChatCall:
        wrapped = self.wrapped
        model = _get(request, "model") or _get(ctx, "model") or getattr(wrapped, "model_name", None)
        call = self.telemetry.start_chat(
            model=model,
            provider=getattr(wrapped, "name", None),
            gen_ai_provider=getattr(wrapped, "gen_ai_provider_name", None),
            ctx=ctx,
            request=request,
            stream=stream,
            parent=parent,
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

    def stream(self, request: Any, ctx: Any) -> AsyncIterator[Any]:
        # The parent is taken now, at call time: an async generator's body runs later, in whatever
        # context iterates it (e.g. the HTTP server's response task).
        return self._stream(request, ctx, _parent_of(ctx) or otel_context.get_current())

    async def _stream(self, request: Any, ctx: Any, parent: otel_context.Context) -> AsyncIterator[Any]:
        call = self._start(request, ctx, stream=True, parent=parent)
        fields: dict[str, Any] = {}
        chunks = self.wrapped.stream(request, ctx)
        try:
            async for chunk in chunks:
                if call.first_chunk_s is None and _chunk_has_content(chunk):
                    call.first_chunk()
                _merge_chunk_fields(fields, chunk)
                yield chunk
        except BaseException as exc:  # GeneratorExit too: the consumer went away mid-stream
            call.fail(exc)
            raise
        finally:
            # Closed now, not when the garbage collector gets to it: the provider stops generating.
            aclose = getattr(chunks, "aclose", None)
            if aclose is not None:
                await aclose()
        call.finish(**fields)


def _parent_of(ctx: Any) -> otel_context.Context | None:
    attributes = _get(ctx, "attributes")
    return attributes.get(OTEL_CONTEXT_KEY) if attributes else None


def _usage_tokens(usage: Any) -> tuple[int | None, int | None, int | None]:
    """(input, output, cached input) tokens of an OpenAI-style usage."""
    return (
        _first(usage, "prompt_tokens", "input_tokens"),
        _first(usage, "completion_tokens", "output_tokens"),
        _get(_get(usage, "prompt_tokens_details"), "cached_tokens"),
    )


def _result_fields(result: Any) -> dict[str, Any]:
    input_tokens, output_tokens, cached_tokens = _usage_tokens(_get(result, "usage"))
    return {
        "response_id": _get(result, "id"),
        "response_model": _get(result, "model"),
        "finish_reason": _get(result, "finish_reason"),
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "cached_input_tokens": cached_tokens,
        "speculation": _figures(_get(result, "speculation"), _get(result, "stats")),
        "output_message": _get(result, "message"),
    }


# What the spans and metrics read off the engine's GenerationStats (read field by field: asdict() of the
# whole dataclass costs more than the rest of the tracing of a call).
_STATS_FIELDS = (
    "method", "gamma", "draft_proposed", "draft_accepted", "acceptance_rate", "target_passes",
    "mean_tokens_per_pass", "tokens_per_second", "ttft_s", "draft_s", "verify_s", "total_s",
    "queue_s", "decode_s", "rule", "policy_version",
)  # fmt: skip
_SPEC_FIELDS = ("method", "gamma", "proposed", "accepted", "acceptance_rate", "target_passes", "rule",
                "policy_version", "pool")  # fmt: skip


def _figures(speculation: Any, stats: Any) -> dict[str, Any] | None:
    """One view of a call's figures: the engine's stats (latency parts) under the reported
    SpeculationInfo (which also names the pool)."""
    if speculation is None and stats is None:
        return None
    merged: dict[str, Any] = {}
    if stats is not None:
        for name in _STATS_FIELDS:
            value = getattr(stats, name, None)
            if value is not None:
                merged[name] = value
    if speculation is not None:
        for name in _SPEC_FIELDS:
            value = _get(speculation, name)
            if value is not None:
                merged[name] = value
        accept_length = _get(speculation, "accept_length")
        if accept_length is not None:
            merged.setdefault("mean_tokens_per_pass", accept_length)
    return merged


def _chunk_has_content(chunk: Any) -> bool:
    delta = _get(chunk, "delta", chunk)
    return bool(_get(delta, "content") or _get(delta, "tool_calls") or _get(chunk, "text"))


def _merge_chunk_fields(fields: dict[str, Any], chunk: Any) -> None:
    if (value := _get(chunk, "id")) is not None:
        fields["response_id"] = value
    if (value := _get(chunk, "model")) is not None:
        fields["response_model"] = value
    if (value := _get(chunk, "finish_reason")) is not None:
        fields["finish_reason"] = value
    speculation, stats = _get(chunk, "speculation"), _get(chunk, "stats")
    if speculation is not None or stats is not None:
        fields["speculation"] = _figures(speculation, stats)
    usage = _get(chunk, "usage")
    if usage is not None:
        fields["input_tokens"], fields["output_tokens"], fields["cached_input_tokens"] = _usage_tokens(usage)
