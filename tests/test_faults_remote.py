"""Remote replies missing a field the runner needs: a bad response, never a quiet default.

A finish reason, a tool call's id and its arguments are required (as its function name already was).
Missing, each is a `ProviderBadResponse` (code bad_response, fallback before the first token), plain
and streamed alike; after the first chunk went out, the stream breaks (`StreamBroken`). Read through
the shared wire readers and the self-hosted pool provider's real HTTP path (SGLang dialect)."""

from __future__ import annotations

import json

import httpx
import pytest
from stand_ins.streams import joined_tool_calls, read_all

from openalice_runner.providers import openai_wire as wire
from openalice_runner.providers.base import CallContext, ProviderBadResponse, StreamBroken
from openalice_runner.providers.pools.sglang import SGLangConfig, SGLangProvider
from openalice_runner.types import ChatRequest

REQ = ChatRequest(messages=[{"role": "user", "content": "hi"}])
CALL = {"id": "call_a", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}


def _without(call: dict, path: str) -> dict:
    call = json.loads(json.dumps(call))
    *parents, last = path.split(".")
    node = call
    for p in parents:
        node = node[p]
    del node[last]
    return call


PLAIN_GAPS = {
    "finish_reason": {"choices": [{"index": 0, "message": {"content": "hello"}}]},
    "finish_reason null": {"choices": [{"index": 0, "message": {"content": "hello"}, "finish_reason": None}]},
    "tool call id": {"choices": [{"message": {"content": None, "tool_calls": [_without(CALL, "id")]},
                                  "finish_reason": "tool_calls"}]},
    "tool call arguments": {"choices": [{"message": {"content": None, "tool_calls": [_without(CALL, "function.arguments")]},
                                         "finish_reason": "tool_calls"}]},
}  # fmt: skip


def _sglang(handler) -> SGLangProvider:
    cfg = SGLangConfig.model_validate({"type": "sglang", "model": "m", "pools": {"off": {"replicas": ["http://s"]}}})
    return SGLangProvider("gpu", cfg, client=httpx.AsyncClient(transport=httpx.MockTransport(handler)))


def _serving(answer):
    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/loads":
            return httpx.Response(200, json={"loads": [{"num_running_reqs": 0, "num_waiting_reqs": 0}]})
        return answer()

    return handle


@pytest.mark.parametrize("gap", list(PLAIN_GAPS))
async def test_a_plain_reply_missing_a_required_field_is_a_bad_response(gap):
    body = PLAIN_GAPS[gap]
    with pytest.raises(ProviderBadResponse):
        reply = wire.read_response(body, "p")
        wire.tool_calls_of(reply.choices[0].message, "p")
        wire.finish_reason(reply.choices[0].finish_reason, False, "p")
    p = _sglang(_serving(lambda: httpx.Response(200, json=body)))
    with pytest.raises(ProviderBadResponse) as caught:
        await p.chat(REQ, CallContext())
    assert caught.value.fallback_ok and caught.value.code == "bad_response"
    await p.aclose()


def test_a_complete_plain_reply_keeps_what_upstream_sent():
    reply = wire.read_response({"choices": [{"message": {"tool_calls": [CALL]}, "finish_reason": "tool_calls"}]}, "p")
    (call,) = wire.tool_calls_of(reply.choices[0].message, "p")
    assert (call.id, call.function.name, call.function.arguments) == ("call_a", "f", '{"x": 1}')
    assert wire.finish_reason(reply.choices[0].finish_reason, True, "p") == "tool_calls"


def _chunk(delta: dict | None = None, finish: str | None = None) -> str:
    choice = {"index": 0, "delta": delta or {}, "finish_reason": finish}
    return "data: " + json.dumps({"id": "x", "object": "chat.completion.chunk", "choices": [choice]})


def _call_piece(**fields) -> dict:
    return {"tool_calls": [{"index": 0, **fields}]}


TEXT = _chunk({"content": "hi"})
STREAM_GAPS = {  # each: the events after the stream's first text chunk (if any)
    "finish_reason": [_chunk({"content": " there"})],
    "tool call id": [_chunk(_call_piece(function={"name": "f", "arguments": "{}"})), _chunk(finish="tool_calls")],
    "tool call name": [_chunk(_call_piece(id="c", function={"arguments": "{}"})), _chunk(finish="tool_calls")],
    "tool call arguments": [_chunk(_call_piece(id="c", function={"name": "f"})), _chunk(finish="tool_calls")],
}


def _sse(lines: list[str]):
    text = "\n\n".join([*lines, "data: [DONE]"]) + "\n\n"
    return lambda: httpx.Response(200, text=text, headers={"content-type": "text/event-stream"})


@pytest.mark.parametrize("gap", list(STREAM_GAPS))
async def test_a_streamed_reply_missing_a_required_field_is_a_bad_response_before_the_first_token(gap):
    p = _sglang(_serving(_sse(STREAM_GAPS[gap])))
    if gap in ("finish_reason", "tool call arguments"):  # seen at the end, after pieces went out: it breaks
        with pytest.raises(StreamBroken):
            await read_all(p.stream(REQ, CallContext()))
    else:
        with pytest.raises(ProviderBadResponse) as caught:
            await read_all(p.stream(REQ, CallContext()))
        assert caught.value.fallback_ok
    await p.aclose()


@pytest.mark.parametrize("gap", list(STREAM_GAPS))
async def test_a_streamed_reply_missing_a_required_field_breaks_the_stream_after_the_first_token(gap):
    p = _sglang(_serving(_sse([TEXT, *STREAM_GAPS[gap]])))
    got = []
    with pytest.raises(StreamBroken):
        async with p.stream(REQ, CallContext()) as chunks:
            async for chunk in chunks:
                got.append(chunk.delta_text)
    assert got and got[0] == "hi"
    await p.aclose()


def test_the_accumulator_invents_nothing():
    acc = wire.ChunkAccumulator("m", "p")
    acc.feed(wire.read_chunk(json.loads(_chunk({"content": "hi"})[6:]), "p"))
    with pytest.raises(StreamBroken, match="finish_reason"):
        acc.final(wire.SpeculationInfo(method="off"), "p")
    acc = wire.ChunkAccumulator("m", "p")
    with pytest.raises(ProviderBadResponse, match="no id"):
        acc.feed(wire.read_chunk(json.loads(STREAM_GAPS["tool call id"][0][6:]), "p"))


async def test_a_call_the_budget_cut_before_its_arguments_began_ends_in_length_plain_and_streamed():
    """vLLM 0.32 on a forced call whose envelope the budget ends: the call's id and name, then
    finish `length` (seen live, SmolLM2 at max_tokens 16). That is a cut reply, not a malformed one:
    the call with its arguments so far (""), finish `length`; the same gap under `tool_calls` is
    still a bad response (above)."""
    cut = [_chunk(_call_piece(id="c", type="function", function={"name": "f"})), _chunk(finish="length")]
    p = _sglang(_serving(_sse(cut)))
    chunks = await read_all(p.stream(REQ, CallContext()))
    assert joined_tool_calls(chunks) == [{"id": "c", "name": "f", "arguments": ""}]
    assert chunks[-1].finish_reason == "length"
    body = {"choices": [{"message": {"content": None, "tool_calls": [_without(CALL, "function.arguments")]},
                         "finish_reason": "length"}]}  # fmt: skip
    p = _sglang(_serving(lambda: httpx.Response(200, json=body)))
    r = await p.chat(REQ, CallContext())
    assert r.finish_reason == "length" and [(c.id, c.function.name, c.function.arguments) for c in r.tool_calls] == [
        ("call_a", "f", "")]  # fmt: skip
    await p.aclose()
