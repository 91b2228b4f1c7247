"""The OpenAI Responses wire (`POST /v1/responses`): its translation onto the chat request, its reply
and stream events, and the real `openai` SDK's `client.responses.create` against the app.

The translation tests are pure (no model). The SDK tests run the app over loopback on the embedded
tiny random model: a random model calls a tool only when forced, which is what the forced-tool tests
do (the engine decodes the call under a grammar, so it parses).
"""

from __future__ import annotations

import json
from contextlib import asynccontextmanager

import pytest

from openalice_runner.providers.base import StreamBroken, scoped_conversation
from openalice_runner.server.errors import APIError
from openalice_runner.server.wires.responses.body import parse_responses_request
from openalice_runner.server.wires.responses.events import ResponseEvents, sse_event
from openalice_runner.server.wires.responses.reply import response_of, shell_of
from openalice_runner.server.wires.responses.store import ResponseStore, credential_of
from openalice_runner.server.wires.responses.translate import to_chat
from openalice_runner.types import (
    ChatChunk,
    ChatMessage,
    ChatResult,
    FunctionCallDelta,
    ToolCall,
    ToolCallDelta,
    Usage,
)

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather in a city",
    "strict": True,
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                   "additionalProperties": False},
}  # fmt: skip
UNITS = {
    "type": "function",
    "name": "set_units",
    "parameters": {"type": "object", "properties": {"unit": {"enum": ["c", "f"]}}, "required": ["unit"],
                   "additionalProperties": False},
}  # fmt: skip
NAMESPACE = {
    "type": "namespace",
    "name": "agents",
    "description": "Sub-agents",
    "tools": [{"type": "function", "name": "spawn", "strict": False,
               "parameters": {"type": "object", "properties": {"task": {"type": "string"}}}}],
}  # fmt: skip


def parse(body: dict) -> object:
    return parse_responses_request(json.dumps(body).encode(), "application/json")


def error_of(body: dict | bytes) -> APIError:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    with pytest.raises(APIError) as caught:
        to_chat(parse_responses_request(raw, "application/json"), max_tokens_limit=1000)
    return caught.value


# ---------------------------------------------------------------- request -> chat


def test_string_input_and_instructions_become_system_then_user():
    t = to_chat(parse({"model": "m", "instructions": "Be brief.", "input": "Hi", "max_output_tokens": 20,
                       "temperature": 0.5, "top_p": 0.9}))  # fmt: skip
    req = t.request
    assert [(m.role, m.content) for m in req.messages] == [("system", "Be brief."), ("user", "Hi")]
    assert (req.max_tokens, req.temperature, req.top_p, req.model) == (20, 0.5, 0.9, "m")
    assert [m.role for m in t.conversation] == ["user"]  # instructions are not carried over


def test_items_of_every_role_and_a_tool_round_trip():
    t = to_chat(parse({
        "tools": [WEATHER],
        "input": [
            {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Dev."}]},
            {"role": "system", "content": "Sys."},
            {"role": "user", "content": [{"type": "input_text", "text": "Weather "},
                                         {"type": "input_text", "text": "in Paris?"}]},
            {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "opaque"},
            {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
             "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city":"Paris"}'},
            {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": '{"city":"Lyon"}'},
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
            {"type": "function_call_output", "call_id": "call_2",
             "output": [{"type": "input_text", "text": "rain"}]},
        ],
    }))  # fmt: skip
    msgs = t.request.messages
    assert [m.role for m in msgs] == ["developer", "system", "user", "assistant", "tool", "tool"]
    assert msgs[2].content == "Weather in Paris?"
    assert msgs[3].content == "Checking." and [c.id for c in msgs[3].tool_calls] == ["call_1", "call_2"]
    assert [(m.tool_call_id, m.content) for m in msgs[4:]] == [("call_1", "sunny"), ("call_2", "rain")]
    assert t.request.tools[0].function.strict is True and t.request.effective_tool_choice == "auto"


def test_an_output_may_answer_the_previous_responses_call():
    previous = [
        ChatMessage(role="user", content="Weather?"),
        ChatMessage(role="assistant", tool_calls=[ToolCall(id="call_1", function={"name": "get_weather",
                                                                                    "arguments": "{}"})]),
    ]  # fmt: skip
    body = parse({"tools": [WEATHER], "previous_response_id": "resp_1",
                  "input": [{"type": "function_call_output", "call_id": "call_1", "output": "sunny"}]})  # fmt: skip
    msgs = to_chat(body, previous=previous).request.messages
    assert [m.role for m in msgs] == ["user", "assistant", "tool"] and msgs[2].tool_call_id == "call_1"
    with pytest.raises(APIError) as caught:  # answered already: a second answer answers nothing
        to_chat(body, previous=[*previous, ChatMessage(role="tool", tool_call_id="call_1", content="x")])
    assert caught.value.param == "input[0].call_id"


def test_namespace_tools_are_flattened_and_named_back():
    t = to_chat(parse({"tools": [WEATHER, NAMESPACE], "tool_choice": {"type": "function", "name": "spawn"},
                       "input": "go"}))  # fmt: skip
    assert [tool.function.name for tool in t.request.tools] == ["get_weather", "agents__spawn"]
    assert t.request.tool_choice.function.name == "agents__spawn"  # resolved as vLLM does
    result = ChatResult.single(
        model="m", content=None, finish_reason="tool_calls",
        tool_calls=[ToolCall(id="call_9", function={"name": "agents__spawn", "arguments": '{"task":"x"}'})],
    )  # fmt: skip
    reply = response_of(shell_of(parse({"input": "go"}), []), result, t.tool_names)
    (item,) = reply["output"]
    assert item["type"] == "function_call" and (item["name"], item["namespace"]) == ("spawn", "agents")
    # the call sent back with its namespace is the flattened call the model made
    again = to_chat(parse({"tools": [NAMESPACE], "input": [
        {"type": "function_call", "call_id": "call_9", "name": "spawn", "namespace": "agents", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_9", "output": "ok"}]}))  # fmt: skip
    assert again.request.messages[0].tool_calls[0].function.name == "agents__spawn"


def test_hosted_tools_are_left_out_and_named_unless_forced():
    t = to_chat(parse({"tools": [WEATHER, {"type": "web_search", "external_web_access": False},
                                 {"type": "file_search", "vector_store_ids": ["v"]}], "input": "x"}))  # fmt: skip
    assert [tool.name for tool in t.request.tools] == ["get_weather"]
    assert t.tools_not_offered == ["web_search", "file_search"]
    reply = response_of(shell_of(parse({"input": "x"}), t.tools_not_offered), ChatResult.single(model="m", content="hi"),
                        {})  # fmt: skip
    assert reply["tools_not_offered"] == ["web_search", "file_search"]
    err = error_of(
        {"tools": [{"type": "web_search"}], "tool_choice": {"type": "web_search_preview"}, "input": "x"}
    )
    assert err.status_code == 400 and err.param == "tool_choice" and "web_search_preview" in err.message
    err = error_of({"tools": [{"type": "web_search"}], "tool_choice": "required", "input": "x"})
    assert err.param == "tool_choice"


def test_tool_choice_forms():
    base = {"tools": [WEATHER, {**WEATHER, "name": "get_time"}], "input": "x"}
    assert to_chat(parse({**base, "tool_choice": "required"})).request.tool_choice == "required"
    assert to_chat(parse({**base, "tool_choice": "none"})).request.effective_tool_choice == "none"
    named = to_chat(parse({**base, "tool_choice": {"type": "function", "name": "get_time"}})).request
    assert named.tool_choice.function.name == "get_time"
    allowed = to_chat(parse({**base, "tool_choice": {"type": "allowed_tools", "mode": "required", "tools": [
        {"type": "function", "name": "get_time"}, {"type": "image_generation"}]}})).request  # fmt: skip
    assert (
        allowed.tool_choice.allowed_tools.names == ["get_time"]
        and allowed.tool_choice.allowed_tools.mode == "required"
    )
    assert error_of({**base, "tool_choice": {"type": "function", "name": "nope"}}).param == "tool_choice.name"


def test_text_format_becomes_response_format():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    req = to_chat(parse({"input": "x", "text": {"format": {"type": "json_schema", "name": "A", "schema": schema,
                                                            "strict": True}, "verbosity": "low"}})).request  # fmt: skip
    assert req.response_format.type == "json_schema" and req.response_format.json_schema.schema_ == schema
    assert to_chat(
        parse({"input": "x", "text": {"format": {"type": "json_object"}}})
    ).request.response_format.type == ("json_object")
    assert (
        to_chat(parse({"input": "x", "text": {"format": {"type": "text"}}})).request.response_format is None
    )


def test_codex_fields_are_accepted():
    """What `codex exec` 0.171 sent, less its prompt: every field accepted."""
    t = to_chat(parse({
        "model": "smollm2", "stream": True, "input": [{"type": "message", "role": "user",
                                                       "content": [{"type": "input_text", "text": "hi"}]}],
        "tools": [WEATHER, NAMESPACE, {"type": "web_search", "external_web_access": False}],
        "tool_choice": "auto", "parallel_tool_calls": True, "reasoning": {"summary": "auto"}, "store": False,
        "include": ["reasoning.encrypted_content"], "prompt_cache_key": "sess-1",
        "client_metadata": {"session_id": "sess-1", "x-codex-turn-metadata": "{}"},
    }))  # fmt: skip
    assert t.request.stream and t.request.parallel_tool_calls and t.tools_not_offered == ["web_search"]


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        ({"input": "x", "foo": 1}, "foo", "unknown_parameter"),
        ({"input": "x", "model": "m" * 257}, "model", "invalid_value"),  # was a 500: the chat request's bound
        ({"input": [{"role": "user"}]}, "input[0].content", "missing_required_parameter"),
        ({"input": [{"role": "user", "content": [{"type": "input_text", "text": "x", "txt": "x"}]}]}, "input[0].content[0].txt",
         "unknown_parameter"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:"}]}]},
         "input[0].content[0]", "invalid_value"),
        ({"input": [{"role": "wizard", "content": "x"}]}, "input[0].role", "invalid_value"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type", "invalid_value"),
        ({"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]}, "input[0].call_id",
         "invalid_value"),
        ({"input": [{"role": "assistant", "content": [{"type": "input_text", "text": "x"}]}]},
         "input[0].content[0].type", "invalid_value"),
        ({"input": 3}, "input", "invalid_type"),
        ({"input": "x", "tools": [{"type": "function", "name": "bad name"}]}, "tools[0].name", "invalid_value"),
        ({"input": "x", "tools": [{"type": "function", "name": "f", "parameters": {"type": "array"}}]},
         "tools[0].parameters", "invalid_value"),
        ({"input": "x", "tools": [WEATHER, WEATHER]}, "tools[1].name", "invalid_value"),
        ({"input": "x", "tools": [{"type": "wizardry"}]}, "tools[0]", "invalid_value"),
        ({"input": "x", "tool_choice": {"type": "function"}}, "tool_choice.name", "missing_required_parameter"),
        ({"input": "x", "text": {"format": {"type": "json_schema", "name": "a"}}}, "text.format.schema",
         "missing_required_parameter"),
        ({"input": "x", "text": {"format": {"type": "json_schema", "name": "a", "schema": {"type": 3}}}},
         "text.format.schema", "invalid_value"),
        ({"input": "x", "temperature": 3}, "temperature", "invalid_value"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens", "invalid_value"),
        ({"input": "x", "max_output_tokens": 5000}, "max_output_tokens", "invalid_value"),
        ({"input": "x", "stream": "yes"}, "stream", "invalid_type"),
        ({"input": "x", "background": True}, "background", "unsupported_parameter"),
        ({"input": "x", "include": ["message.output_text.logprobs"]}, "include[0]", "unsupported_parameter"),
        ({"input": "x", "metadata": {"k": "v" * 513}}, "metadata.k", "invalid_value"),
        ({"input": "x", "metadata": {"k": 1}}, "metadata.k", "invalid_type"),
        ({}, "input", "missing_required_parameter"),
        # a `type` that is no string (the server fuzz test found these answered with a 500)
        ({"input": [{"type": [1]}]}, "input[0].type", "invalid_type"),
        ({"input": "x", "tools": [{"type": [1]}]}, "tools[0]", "invalid_value"),
        ({"input": "x", "text": {"format": {"type": {}}}}, "text.format", "invalid_value"),
        ({"input": "\ud800"}, "input", "invalid_unicode"),
        # a history call's arguments nested past what rendering the prompt survives (was a RecursionError)
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[" * 5000}]},
         "input[0].arguments", "invalid_value"),
    ],
)  # fmt: skip
def test_malformed_requests_name_the_field_in_openai_shape(body, param, code):
    err = error_of(body)
    assert err.status_code == 400 and err.param == param and err.code == code, err.body()
    assert err.body()["error"]["type"] == "invalid_request_error" and param in err.message


def test_lone_surrogates_are_found_however_they_came():
    """An escape, escaped pairs (valid) beside one, and a surrogate's own UTF-8 bytes (json.loads reads
    bytes with surrogatepass): each lone one is a 400 naming its field; a valid pair passes."""
    assert to_chat(parse({"input": "\U0001f600"})).request.messages[0].content == "\U0001f600"
    for raw in (b'{"input": "\\ud800"}', b'{"input": "\\ud83d\\ude00", "instructions": "\\uDC00"}',
                b'{"input": "\xed\xa0\x80"}'):  # fmt: skip
        err = error_of(raw)
        assert err.code == "invalid_unicode" and err.param in ("input", "instructions"), (raw, err.body())


def test_bodies_that_are_not_objects():
    for raw in (b"", b"[1]", b"{", b'"x"'):
        err = error_of(raw)
        assert err.status_code == 400 and err.code in ("invalid_body", "invalid_json")


# ---------------------------------------------------------------- reply


def test_reply_items_status_and_usage():
    body = parse({"model": "m", "input": "x", "max_output_tokens": 5, "metadata": {"a": "b"}})
    result = ChatResult.single(model="m", content="Hello", finish_reason="length",
                               usage=Usage.of(10, 5, cached_tokens=4))  # fmt: skip
    reply = response_of(shell_of(body, []), result, {})
    assert reply["id"].startswith("resp_") and reply["object"] == "response"
    assert reply["status"] == "incomplete" and reply["incomplete_details"] == {"reason": "max_output_tokens"}
    (item,) = reply["output"]
    assert item["type"] == "message" and item["id"].startswith("msg_") and item["status"] == "incomplete"
    assert item["content"][0]["text"] == "Hello"
    assert reply["usage"] == {"input_tokens": 10, "input_tokens_details": {"cached_tokens": 4, "cache_write_tokens": 0}, "output_tokens": 5,
                              "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 15}  # fmt: skip
    assert reply["metadata"] == {"a": "b"} and reply["max_output_tokens"] == 5
    from openai.types.responses import Response

    parsed = Response.model_validate(reply)  # the SDK's own type takes it
    assert parsed.output_text == "Hello"


# ---------------------------------------------------------------- stream events


def _chunks(pieces: list[ChatChunk], finish: str, usage: Usage) -> list[ChatChunk]:
    last = ChatChunk(id="c", model="m", usage=usage)
    last.choices = [type(pieces[0].choices[0])(finish_reason=finish)]
    return [*pieces, last]


def test_stream_events_for_text_then_a_call():
    t = to_chat(parse({"tools": [NAMESPACE], "input": "go"}))
    events = ResponseEvents(shell_of(parse({"input": "go"}), []), t.tool_names)
    pieces = [
        ChatChunk.piece("c", "m", content="Let me ", first=True),
        ChatChunk.piece("c", "m", content="see."),
        ChatChunk.piece("c", "m", tool_calls=[ToolCallDelta(index=0, id="call_1", type="function",
                                                            function=FunctionCallDelta(name="agents__spawn", arguments=""))]),
        ChatChunk.piece("c", "m", tool_calls=[ToolCallDelta(index=0, function=FunctionCallDelta(arguments='{"task":'))]),
        ChatChunk.piece("c", "m", tool_calls=[ToolCallDelta(index=0, function=FunctionCallDelta(arguments='"x"}'))]),
    ]  # fmt: skip
    out = events.start()
    for chunk in _chunks(pieces, "tool_calls", Usage.of(7, 9)):
        out += events.feed(chunk)
    out += events.finish()
    assert [e["type"] for e in out] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed",
    ]  # fmt: skip
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    final = out[-1]["response"]
    assert [i["type"] for i in final["output"]] == ["message", "function_call"]
    call = final["output"][1]
    assert (call["name"], call["namespace"], call["arguments"], call["call_id"]) == ("spawn", "agents", '{"task":"x"}',
                                                                                      "call_1")  # fmt: skip
    assert final["usage"]["output_tokens"] == 9 and out[-1]["response"] is events.response
    from openai.types.responses import ResponseStreamEvent
    from pydantic import TypeAdapter

    adapter = TypeAdapter(ResponseStreamEvent)
    for event in out:  # every event is one the SDK's own union takes
        adapter.validate_python(event)
    frame = sse_event(out[0])
    assert frame.startswith(b"event: response.created\ndata: {") and frame.endswith(b"\n\n")


def test_stream_that_runs_out_is_incomplete_and_a_fault_is_an_error_then_failed():
    events = ResponseEvents(shell_of(parse({"input": "x"}), []), {})
    out = events.start()
    for chunk in _chunks([ChatChunk.piece("c", "m", content="abc", first=True)], "length", Usage.of(1, 3)):
        out += events.feed(chunk)
    out += events.finish()
    assert out[-1]["type"] == "response.incomplete"
    assert out[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    failing = ResponseEvents(shell_of(parse({"input": "x"}), []), {})
    failing.start()
    tail = failing.fail(APIError(400, "prompt too long", code="context_length_exceeded"))
    assert [e["type"] for e in tail] == ["error", "response.failed"]
    assert tail[0]["code"] == "context_length_exceeded"
    assert tail[1]["response"]["error"]["code"] == "context_length_exceeded"
    assert tail[1]["response"]["status"] == "failed"


def test_a_call_continued_after_another_began_is_a_broken_stream():
    events = ResponseEvents(shell_of(parse({"input": "x"}), []), {})
    events.start()

    def call(index, **kw):
        return ChatChunk.piece("c", "m", tool_calls=[ToolCallDelta(index=index, function=FunctionCallDelta(**kw),
                                                                   id=kw.pop("id", None))])  # fmt: skip

    events.feed(
        ChatChunk.piece(
            "c", "m", tool_calls=[ToolCallDelta(index=0, id="a", function=FunctionCallDelta(name="f"))]
        )
    )
    events.feed(
        ChatChunk.piece(
            "c", "m", tool_calls=[ToolCallDelta(index=1, id="b", function=FunctionCallDelta(name="g"))]
        )
    )
    with pytest.raises(StreamBroken):
        events.feed(
            ChatChunk.piece(
                "c", "m", tool_calls=[ToolCallDelta(index=0, function=FunctionCallDelta(arguments="{"))]
            )
        )


# ---------------------------------------------------------------- store


def test_store_is_bounded_and_per_credential():
    store = ResponseStore(max_entries=2)
    alice = credential_of({"authorization": "Bearer alice"})
    assert alice and alice != credential_of({"x-api-key": "bob"}) and credential_of({}) == ""
    for rid in ("r1", "r2", "r3"):
        store.put(alice, rid, [ChatMessage(role="user", content=rid)])
    assert len(store) == 2 and store.get(alice, "r3")[0].content == "r3"
    for cred, rid in ((alice, "r1"), (credential_of({"x-api-key": "bob"}), "r3")):
        with pytest.raises(APIError) as caught:
            store.get(cred, rid)
        assert (
            caught.value.code == "previous_response_not_found"
            and caught.value.param == "previous_response_id"
        )


# ---------------------------------------------------------------- the openai SDK against the app

API_KEY = "responses-key"
PROVIDERS = """
providers:
  local: {type: local, tiny_random: true, max_tokens_default: 24}
routes:
  - {name: default, match: {models: ["*"]}, chain: [local]}
"""


@pytest.fixture(scope="module")
def live():
    from stand_ins.engines import tiny_engine
    from support.live_server import LiveServer

    from openalice_runner.providers.config import load_routing_text
    from openalice_runner.runner import Runner
    from openalice_runner.server.app import ServerSettings, create_app

    class FaultyRunner(Runner):
        """The real Runner; with `fail` set, a stream breaks after its first chunk."""

        fail = False

        def stream(self, request, ctx=None):
            opened = super().stream(request, ctx)
            if not self.fail:
                return opened

            @asynccontextmanager
            async def broken():
                async with opened as chunks:

                    async def pieces():
                        yield await anext(chunks)
                        raise StreamBroken("cut for the test", provider="local")

                    yield pieces()

            return broken()

    runner = FaultyRunner.from_config(
        providers=load_routing_text(PROVIDERS), policy=False, telemetry=False, engine=tiny_engine()
    )
    app = create_app(runner, settings=ServerSettings(api_key=API_KEY, request_timeout_s=120))
    server = LiveServer(app).start()
    app.state.test_runner = runner
    yield server, app
    server.stop()


@pytest.fixture
def client(live):
    import openai

    server, _ = live
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def test_sdk_plain_reply(client):
    r = client.responses.create(model="tiny", instructions="Be brief.", input="Say hi", max_output_tokens=6)
    assert r.id.startswith("resp_") and r.object == "response" and r.status in ("completed", "incomplete")
    assert r.output[0].type == "message" and isinstance(r.output_text, str)
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens"
    u = r.usage
    assert (
        u.input_tokens > 0 and 0 < u.output_tokens <= 6 and u.total_tokens == u.input_tokens + u.output_tokens
    )
    assert u.input_tokens_details.cached_tokens >= 0 and r.instructions == "Be brief."


def test_sdk_streamed_events_in_order(client):
    events = list(client.responses.create(model="tiny", input="Say hi", max_output_tokens=6, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]  # fmt: skip
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          f"response.{events[-1].response.status}"]  # fmt: skip
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert final.output_text == deltas and final.usage.output_tokens > 0
    # the SDK's helper (it takes only a `response.completed`): a forced call of a closed choice completes
    # within its budget where a random model's free string would run out (`incomplete`)
    with client.responses.stream(model="tiny", input="Units?", tools=[UNITS], tool_choice="required",
                                 max_output_tokens=24) as stream:  # fmt: skip
        final = stream.get_final_response()
    assert final.status == "completed" and final.output[-1].type == "function_call"


def test_sdk_forced_tool_then_its_result_sent_back(client, live):
    _, app = live
    tools = [WEATHER, NAMESPACE, {"type": "web_search"}]
    r = client.responses.create(
        model="tiny", input="Weather in Paris?", tools=tools, max_output_tokens=24,
        tool_choice={"type": "function", "name": "get_weather"}, extra_headers={"session-id": "codex-thread-1"},
    )  # fmt: skip
    (call,) = [item for item in r.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id and isinstance(json.loads(call.arguments)["city"], str)
    assert r.model_extra["tools_not_offered"] == ["web_search"]
    # the turn waits for the tool, keyed by Codex's session (scoped by the API key's tenant, "default")
    assert scoped_conversation("default", "codex-thread-1") in app.state.tracker._open
    back = client.responses.create(
        model="tiny", tools=tools, max_output_tokens=6, extra_headers={"session-id": "codex-thread-1"},
        input=[{"role": "user", "content": "Weather in Paris?"},
               {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
               {"type": "function_call_output", "call_id": call.call_id, "output": '{"sky": "clear"}'}],
    )  # fmt: skip
    assert back.status in ("completed", "incomplete") and back.output


def test_sdk_forced_namespaced_tool_comes_back_with_its_namespace(client):
    r = client.responses.create(model="tiny", input="Spawn one", tools=[NAMESPACE], max_output_tokens=24,
                                tool_choice="required")  # fmt: skip
    (call,) = [item for item in r.output if item.type == "function_call"]
    assert (call.name, call.namespace) == ("spawn", "agents")
    json.loads(call.arguments)
    streamed = list(client.responses.create(model="tiny", input="Spawn one", tools=[NAMESPACE], max_output_tokens=24,
                                            tool_choice="required", stream=True))  # fmt: skip
    kinds = [e.type for e in streamed]
    assert (
        "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    )
    done = [
        e.item for e in streamed if e.type == "response.output_item.done" and e.item.type == "function_call"
    ]
    assert [(i.name, i.namespace) for i in done] == [("spawn", "agents")]


def test_sdk_previous_response_id(client):
    import openai

    first = client.responses.create(model="tiny", input="Remember 7", max_output_tokens=4)
    second = client.responses.create(model="tiny", input="What number?", previous_response_id=first.id,
                                     max_output_tokens=4)  # fmt: skip
    assert second.previous_response_id == first.id
    # the second continues the first: its prompt holds the first's input and output
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    streamed = list(client.responses.create(model="tiny", input="And?", previous_response_id=second.id,
                                            max_output_tokens=4, stream=True))  # fmt: skip
    third = client.responses.create(
        model="tiny", input="x", previous_response_id=streamed[-1].response.id, max_output_tokens=2
    )  # a streamed response is kept too
    assert third.status in ("completed", "incomplete")
    called = client.responses.create(model="tiny", input="Weather?", tools=[WEATHER], tool_choice="required",
                                     max_output_tokens=24)  # fmt: skip
    (call,) = [item for item in called.output if item.type == "function_call"]
    answered = client.responses.create(model="tiny", tools=[WEATHER], previous_response_id=called.id,
                                       max_output_tokens=2, input=[{"type": "function_call_output",
                                                                    "call_id": call.call_id, "output": "sunny"}])  # fmt: skip
    assert answered.status in ("completed", "incomplete")
    unstored = client.responses.create(model="tiny", input="x", store=False, max_output_tokens=2)
    for missing in ("resp_nope", unstored.id):
        with pytest.raises(openai.BadRequestError) as caught:
            client.responses.create(
                model="tiny", input="x", previous_response_id=missing, max_output_tokens=2
            )
        err = caught.value.body
        assert err["code"] == "previous_response_not_found" and err["param"] == "previous_response_id"


def test_sdk_sees_errors_in_openai_shape(client, live):
    import openai

    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model="tiny", input="x", extra_body={"frobnicate": 1})
    assert caught.value.body["code"] == "unknown_parameter" and caught.value.body["param"] == "frobnicate"
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model="tiny", input=[{"role": "user", "content": [
            {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}])  # fmt: skip
    assert caught.value.body["param"] == "input[0].content[0]"
    server, _ = live
    import openai as sdk

    with pytest.raises(sdk.AuthenticationError):
        sdk.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).responses.create(
            model="t", input="x"
        )


def test_sdk_context_overflow_is_context_length_exceeded_naming_input(client):
    import openai

    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as caught:
            client.responses.create(model="tiny", input="word " * 200_000, stream=stream)
        err = caught.value.body
        assert err["code"] == "context_length_exceeded" and err["param"] == "input", err


def test_sdk_a_fault_after_the_stream_started_is_an_error_event_then_failed(client, live):
    _, app = live
    app.state.test_runner.fail = True
    try:
        events = list(client.responses.create(model="tiny", input="Say hi", max_output_tokens=6, stream=True))
    finally:
        app.state.test_runner.fail = False
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-2:] == [
        "error",
        "response.failed",
    ]
    assert events[-2].code == "stream_broken" and events[-1].response.status == "failed"
    assert events[-1].response.error.code == "stream_broken"
    assert [e.sequence_number for e in events] == list(range(len(events)))
