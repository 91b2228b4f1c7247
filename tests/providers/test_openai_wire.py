"""The OpenAI wire module shared by the SGLang and hosted providers."""

from __future__ import annotations

import pytest

from openalice_runner.providers import openai_wire as wire
from openalice_runner.providers.base import ProviderBadResponse
from openalice_runner.types import ChatRequest

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


def test_request_body_passes_tool_controls_through():
    req = ChatRequest(
        messages=[{"role": "user", "content": "x"}],
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        parallel_tool_calls=False,
        top_k=3,
    )
    body = wire.request_body(req, "m")
    assert body["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert body["parallel_tool_calls"] is False and body["top_k"] == 3 and body["model"] == "m"
    assert "response_format" not in body and "temperature" not in body  # unset: not sent

    class WithFormat(ChatRequest):  # response_format as ChatRequest will carry it
        response_format: dict | None = None

    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "object"}}}
    assert (
        wire.request_body(WithFormat(messages=[{"role": "user", "content": "x"}], response_format=fmt), "m")[
            "response_format"
        ]
        == fmt
    )


def test_request_body_passes_allowed_tools_through_unchanged():
    choice = {"type": "allowed_tools",
              "allowed_tools": {"mode": "required", "tools": [{"type": "function", "function": {"name": "get_weather"}}]}}
    req = ChatRequest(messages=[{"role": "user", "content": "x"}], tools=TOOLS, tool_choice=choice)
    body = wire.request_body(req, "m")
    assert body["tool_choice"] == choice and body["tools"] == TOOLS  # hosted APIs enforce it themselves


def test_finish_reason_and_retry_after():
    assert wire.finish_reason("stop", saw_tool_calls=True) == "tool_calls"
    assert wire.finish_reason("function_call", saw_tool_calls=True) == "tool_calls"
    assert wire.finish_reason("length", saw_tool_calls=True) == "length"
    with pytest.raises(ProviderBadResponse, match="finish_reason missing"):
        wire.finish_reason(None, saw_tool_calls=False)  # never read as a stop
    with pytest.raises(ProviderBadResponse, match="finish_reason 'abort'"):
        wire.finish_reason("abort", saw_tool_calls=False)  # outside OpenAI's set: never read as a stop (issue 46)
    assert wire.retry_after({"retry-after": "2"}) == 2.0
    assert wire.retry_after({"Retry-After": "soon"}) is None and wire.retry_after(None) is None


def test_accumulator_joins_content_tool_calls_and_usage():
    acc = wire.ChunkAccumulator("m")
    chunks = [
        {"id": "a", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
        {"id": "a", "choices": [{"delta": {"tool_calls": [{"id": "c1", "index": 0, "function": {"name": "f", "arguments": ""}}]}}]},
        {"id": "a", "choices": [{"delta": {"tool_calls": [{"id": None, "index": 0, "function": {"arguments": {"k": 1}}}]}}]},
        {"id": "a", "choices": [{"delta": {}, "finish_reason": "stop", "matched_stop": None}]},
        {"id": "a", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4}, "extra": 1},
    ]  # fmt: skip
    out = [piece for c in chunks for piece in acc.feed(wire.read_chunk(c, "p"))]
    assert [p.delta.tool_calls[0].function.arguments for p in out] == ["", '{"k": 1}']
    assert out[0].delta.role == "assistant" and out[0].delta.tool_calls[0].type == "function"
    final = acc.final(wire.SpeculationInfo(method="off"), "p")
    assert final.finish_reason == "tool_calls" and final.usage.completion_tokens == 4


def test_readers_name_what_is_missing():
    with pytest.raises(ProviderBadResponse, match="choices"):
        wire.read_response({"id": "x"}, "p")
    with pytest.raises(ProviderBadResponse, match="function.name"):
        body = wire.read_response({"choices": [{"message": {"tool_calls": [{"id": "c", "function": {}}]},
                                                "finish_reason": "tool_calls"}]}, "p")
        wire.tool_calls_of(body.choices[0].message, "p")
