"""The Anthropic Messages wire (POST /v1/messages, /v1/messages/count_tokens) over real HTTP on loopback,
with the official `anthropic` SDK, on the embedded engine's tiny random model: plain and streamed replies,
forced tool calls that parse, tool results sent back, count_tokens, auth by x-api-key, and every
malformed request answered with a 4xx in Anthropic's error shape naming its field."""

from __future__ import annotations

import json
from contextlib import asynccontextmanager

import httpx
import jsonschema
import pytest

anthropic = pytest.importorskip("anthropic")

from stand_ins.engines import tiny_engine  # noqa: E402
from support.live_server import LiveServer  # noqa: E402

from openalice_runner.providers.base import StreamBroken  # noqa: E402
from openalice_runner.providers.config import load_routing_text  # noqa: E402
from openalice_runner.providers.wrappers.admission import AdmissionRefused  # noqa: E402
from openalice_runner.runner import Runner  # noqa: E402
from openalice_runner.server.app import ServerSettings, create_app  # noqa: E402

KEY = "wire-key-1"
PROVIDERS = """
providers:
  local: {type: local, tiny_random: true, max_tokens_default: 8}
routes:
  - {name: default, chain: [local]}
"""
WEATHER = {
    "name": "get_weather",
    "description": "Weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
    },
}
HI = [{"role": "user", "content": "hi"}]
GREEDY = {"temperature": 0}  # the SDK 2.x leaves sampling out of create()'s arguments; the API takes it


class WireRunner(Runner):
    """The real Runner, recording each call's context; `fail` makes a stream break after its first chunk
    and `refuse` makes every request refused as overload (a full server)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.contexts: list = []
        self.fail = False
        self.refuse = False

    async def chat(self, request, ctx=None):
        self.contexts.append(ctx)
        return await super().chat(request, ctx)

    def stream(self, request, ctx=None):
        self.contexts.append(ctx)
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

    def refusal(self, turn_type, model):
        if self.refuse:
            return AdmissionRefused("slots and queue full", provider="local", retry_after=3)
        return super().refusal(turn_type, model)


@pytest.fixture(scope="module")
def server():
    runner = WireRunner.from_config(
        providers=load_routing_text(PROVIDERS), policy=False, telemetry=False, engine=tiny_engine()
    )
    settings = ServerSettings(api_key=KEY, max_body_bytes=256 * 1024, max_tokens_limit=32_768)
    live = LiveServer(create_app(runner, settings=settings)).start()
    live.runner = runner
    live.model = runner.model_names()[0]
    yield live
    live.stop()


@pytest.fixture
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=60)


def post(server, body, *, path="/v1/messages", headers=None, key=KEY):
    h = {"x-api-key": key} if key else {}
    h.update(headers or {})
    if isinstance(body, (dict, list)):
        return httpx.post(f"{server.url}{path}", json=body, headers=h, timeout=60)
    return httpx.post(f"{server.url}{path}", content=body, headers=h, timeout=60)


def anthropic_error(response: httpx.Response, status: int, kind: str) -> str:
    """The error's message, after checking the response is Anthropic's error shape."""
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"type", "error"} and body["type"] == "error", body
    assert set(body["error"]) == {"type", "message"} and body["error"]["type"] == kind, body
    return body["error"]["message"]


# ---------------------------------------------------------------- replies


def test_plain_reply_is_an_anthropic_message(server, client):
    reply = client.messages.create(model=server.model, max_tokens=6, system="Be brief.", messages=HI)
    assert reply.id.startswith("msg_") and reply.type == "message" and reply.role == "assistant"
    assert [b.type for b in reply.content] == ["text"] and reply.content[0].text
    assert reply.stop_reason == "max_tokens" and reply.stop_sequence is None  # random text runs to the budget
    assert reply.usage.output_tokens == 6 and reply.usage.input_tokens > 0


def test_a_stop_string_is_stop_reason_stop_sequence_naming_it(server, client):
    free = client.messages.create(model=server.model, max_tokens=6, messages=HI, extra_body=GREEDY)
    text = free.content[0].text
    stop = text[len(text) // 2]  # a character the reply writes: the same greedy reply stops at it
    reply = client.messages.create(model=server.model, max_tokens=6, messages=HI, extra_body=GREEDY,
                                   stop_sequences=["never-written", stop])  # fmt: skip
    assert reply.stop_reason == "stop_sequence" and reply.stop_sequence == stop, reply
    assert reply.content[0].text == text[: text.index(stop)] if reply.content else text.index(stop) == 0
    with client.messages.stream(model=server.model, max_tokens=6, messages=HI, extra_body=GREEDY,
                                stop_sequences=[stop]) as stream:  # fmt: skip
        final = stream.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == stop


def test_streamed_reply_is_anthropic_events_in_order(server, client):
    with client.messages.create(model=server.model, max_tokens=5, messages=HI, stream=True) as stream:
        events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"], kinds
    assert kinds[1] == "content_block_start" and kinds[-3] == "content_block_stop", kinds
    assert set(kinds[2:-3]) == {"content_block_delta"}, kinds
    assert events[0].message.id.startswith("msg_") and events[0].message.content == []
    assert all(e.delta.type == "text_delta" for e in events[2:-3])
    delta = events[-2]
    assert delta.delta.stop_reason == "max_tokens" and delta.usage.output_tokens == 5
    assert delta.usage.input_tokens > 0  # cumulative usage: the prompt's count comes at the end


def test_stream_sends_a_ping_after_message_start(server):
    r = post(server, {"model": server.model, "max_tokens": 2, "stream": True, "messages": HI})
    names = [line.split(": ", 1)[1] for line in r.text.splitlines() if line.startswith("event: ")]
    assert names[:2] == ["message_start", "ping"], names
    assert r.headers["content-type"].startswith("text/event-stream")


def test_the_sdk_stream_helper_accumulates_the_message(server, client):
    with client.messages.stream(model=server.model, max_tokens=5, messages=HI) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert final.content[0].text == text and final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 5


def test_forced_tool_is_a_tool_use_block_that_parses(server, client):
    reply = client.messages.create(
        model=server.model,
        max_tokens=40,
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},
    )
    assert reply.stop_reason == "tool_use"
    (block,) = [b for b in reply.content if b.type == "tool_use"]
    assert block.name == "get_weather" and block.id
    jsonschema.validate(block.input, WEATHER["input_schema"])


def test_forced_tool_streams_input_json_deltas_that_parse(server, client):
    with client.messages.create(
        model=server.model,
        max_tokens=40,
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[WEATHER],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        stream=True,
    ) as stream:
        events = list(stream)
    starts = [e for e in events if e.type == "content_block_start"]
    assert [s.content_block.type for s in starts] == ["tool_use"], starts
    assert starts[0].content_block.name == "get_weather" and starts[0].content_block.input == {}
    pieces = [e.delta.partial_json for e in events if e.type == "content_block_delta"]
    assert all(e.delta.type == "input_json_delta" for e in events if e.type == "content_block_delta")
    jsonschema.validate(json.loads("".join(pieces)), WEATHER["input_schema"])
    assert events[-2].delta.stop_reason == "tool_use"


def test_tool_results_sent_back_continue_the_conversation(server, client):
    first = client.messages.create(
        model=server.model,
        max_tokens=40,
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},
    )
    call = next(b for b in first.content if b.type == "tool_use")
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": call.id, "content": [{"type": "text", "text": "18C"}]},
                {"type": "text", "text": "And tomorrow?"},
            ],
        },
    ]
    reply = client.messages.create(model=server.model, max_tokens=4, messages=history, tools=[WEATHER])
    assert reply.stop_reason in ("max_tokens", "end_turn", "tool_use")
    failed = history[:2] + [
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "timeout",
                                      "is_error": True}]}  # fmt: skip
    ]
    assert client.messages.create(model=server.model, max_tokens=2, messages=failed, tools=[WEATHER]).content


def test_count_tokens_is_the_prompt_the_reply_ran(server, client):
    kwargs = {"model": server.model, "system": "Be brief.", "messages": HI, "tools": [WEATHER]}
    counted = client.messages.count_tokens(**kwargs)
    reply = client.messages.create(max_tokens=2, **kwargs)
    assert counted.input_tokens == reply.usage.input_tokens + (reply.usage.cache_read_input_tokens or 0) > 0


def test_a_claude_code_shaped_request_is_served(server):
    """What Claude Code sends (issue 45): system blocks with cache_control and its attribution line, a
    system message inside messages, thinking/context_management/output_config/metadata, betas."""
    body = {
        "model": server.model,
        "max_tokens": 4,
        "stream": True,
        "system": [
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1; cch=1a2b;"},
            {"type": "text", "text": "You are brief.", "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": "Answer in one line.", "cache_control": {"type": "ephemeral", "ttl": "1h"}},
        ],
        "messages": [
            {"role": "system", "content": [{"type": "text", "text": "The date is today."}]},
            {"role": "user", "content": [{"type": "text", "text": "Say hello", "cache_control": {"type": "ephemeral"}}]},
        ],
        "tools": [{**WEATHER, "cache_control": {"type": "ephemeral"}}],
        "thinking": {"type": "adaptive"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "medium"},
        "metadata": {"user_id": json.dumps({"device_id": "d", "session_id": "sess-from-metadata"})},
    }
    headers = {"anthropic-version": "2023-06-01", "anthropic-beta": "claude-code-20250219,made-up-beta-2099-01-01"}
    r = post(server, body, path="/v1/messages?beta=true", headers=headers)
    assert r.status_code == 200 and "event: message_stop" in r.text, r.text
    assert server.runner.contexts[-1].conversation_id == "sess-from-metadata"


def test_history_thinking_blocks_are_accepted_and_not_shown(server, client):
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "secret plan", "signature": "sig"},
            {"type": "redacted_thinking", "data": "opaque"},
            {"type": "text", "text": "hello"},
        ]},
        {"role": "user", "content": "again"},
    ]  # fmt: skip
    with_thinking = client.messages.count_tokens(model=server.model, messages=messages)
    plain = [messages[0], {"role": "assistant", "content": "hello"}, messages[2]]
    assert with_thinking.input_tokens == client.messages.count_tokens(model=server.model, messages=plain).input_tokens


def test_search_results_and_tool_references_reach_the_model_as_text(server, client):
    hit = {"type": "search_result", "source": "https://docs/x", "title": "X", "content": [{"type": "text", "text": "x is 1"}]}
    messages = [
        {"role": "user", "content": "find x"},
        {"role": "assistant", "content": [USE]},
        {"role": "user", "content": [
            {**RESULT, "content": [hit, {"type": "tool_reference", "tool_name": "get_weather"}], "toolset_name": "t"},
            hit,
        ]},
    ]  # fmt: skip
    counted = client.messages.count_tokens(model=server.model, messages=messages, tools=[WEATHER])
    plain = [*messages[:2], {"role": "user", "content": [{**RESULT, "content": "x"}]}]
    assert counted.input_tokens > client.messages.count_tokens(model=server.model, messages=plain, tools=[WEATHER]).input_tokens


def test_conversation_from_the_claude_code_session_header(server, client):
    client.messages.create(
        model=server.model,
        max_tokens=1,
        messages=HI,
        metadata={"user_id": json.dumps({"session_id": "from-metadata"})},
        extra_headers={"X-Claude-Code-Session-Id": "from-header"},
    )
    assert server.runner.contexts[-1].conversation_id == "from-header"
    client.messages.create(model=server.model, max_tokens=1, messages=HI, metadata={"user_id": "opaque-user"})
    assert server.runner.contexts[-1].conversation_id is None  # a plain user id names no conversation


# ---------------------------------------------------------------- auth


def test_x_api_key_and_bearer_both_authenticate(server):
    body = {"model": server.model, "max_tokens": 1, "messages": HI}
    assert post(server, body).status_code == 200
    assert post(server, body, key=None, headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    bearer = anthropic.Anthropic(base_url=server.url, auth_token=KEY, max_retries=0)
    assert bearer.messages.create(max_tokens=1, **{"model": server.model, "messages": HI}).content is not None


@pytest.mark.parametrize(
    "headers",
    [{}, {"x-api-key": "wrong"}, {"Authorization": "Bearer wrong"},
     {"x-api-key": "wrong", "Authorization": f"Bearer {KEY}"}, {"x-api-key": KEY, "Authorization": "Bearer wrong"}],
)  # fmt: skip
def test_a_missing_or_wrong_key_is_anthropics_401(server, headers):
    r = post(server, {"model": server.model, "max_tokens": 1, "messages": HI}, key=None, headers=headers)
    assert "API key" in anthropic_error(r, 401, "authentication_error")


def test_the_sdk_raises_its_authentication_error(server):
    bad = anthropic.Anthropic(base_url=server.url, api_key="nope", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        bad.messages.create(model=server.model, max_tokens=1, messages=HI)


def test_the_chat_route_keeps_openais_error_shape(server):
    r = httpx.post(f"{server.url}/v1/chat/completions", json={}, headers={"x-api-key": "wrong"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


# ---------------------------------------------------------------- errors


def _body(**fields):
    return {"model": "M", "max_tokens": 4, "messages": HI, **fields}


USE = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}
RESULT = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "18C"}
MALFORMED = [
    ({"model": "M", "messages": HI}, "max_tokens"),
    (_body(max_tokens=0), "max_tokens"),
    (_body(max_tokens=10**9), "max_tokens"),
    (_body(messages=[]), "messages"),
    (_body(messages=[{"role": "tool", "content": "x"}]), "messages.0.role"),
    (_body(messages=[{"role": "user", "content": [{"type": "text"}]}]), "messages.0.content.0.text"),
    (_body(messages=[{"role": "user", "content": [{"type": "video", "url": "x"}]}]), "messages.0.content.0.type"),
    (_body(messages=[{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "u"}}]}]),
     "messages.0.content.0"),
    (_body(messages=[{"role": "user", "content": [{"type": "document", "source": {"type": "text", "data": "d"}}]}]),
     "messages.0.content.0"),
    (_body(messages=[{"role": "user", "content": "a"}, {"role": "assistant", "content": [USE]},
                     {"role": "user", "content": [{**RESULT, "content": [{"type": "image", "source": {}}]}]}]),
     "messages.2.content.0.content.0"),
    (_body(messages=[{"role": "user", "content": [RESULT]}]), "messages.0.content.0.tool_use_id"),
    (_body(messages=[{"role": "user", "content": "a"}, {"role": "assistant", "content": [USE]},
                     {"role": "user", "content": "no result"}]), "messages.1"),
    (_body(messages=[{"role": "user", "content": "a"}, {"role": "assistant", "content": "prefill"}]), "messages.1"),
    (_body(messages=[{"role": "user", "content": [USE]}]), "messages.0.content.0.type"),
    (_body(messages=[{"role": "user", "content": [{"type": "server_tool_use", "id": "s", "name": "web_search",
                                                    "input": {}}]}]), "messages.0.content.0.type"),
    (_body(messages=[{"role": "user", "content": [{"type": "tool_reference", "tool_name": "t"}]}]),
     "messages.0.content.0.type"),
    (_body(system=[{"type": "image", "source": {}}]), "system.0.type"),
    (_body(temperature=1.5), "temperature"),
    (_body(top_p=0), "top_p"),
    (_body(top_k=-1), "top_k"),
    (_body(stop_sequences=[""]), "stop_sequences.0"),
    (_body(stream="yes"), "stream"),
    (_body(unknown_field=1), "unknown_field"),
    (_body(tools=[{"name": "bad name!", "input_schema": {"type": "object"}}]), "tools.0.name"),
    (_body(tools=[{"name": "t", "input_schema": {"type": "array"}}]), "tools.0"),
    (_body(tools=[{"name": "t", "input_schema": {"type": "object", "properties": 3}}]), "tools.0.input_schema"),
    (_body(tools=[{"name": "t" * 100, "input_schema": {"type": "object"}}]), "tools.0.name"),
    (_body(tools=[{"type": "bash_20250124", "name": "bash"}]), "tools.0"),
    (_body(tools=[WEATHER], tool_choice={"type": "tool"}), "tool_choice"),
    (_body(tools=[WEATHER], tool_choice={"type": "tool", "name": "other"}), "tool_choice"),
    (_body(tools=[WEATHER], tool_choice={"type": "sometimes"}), "tool_choice.type"),
    (_body(thinking={"type": "enabled", "budget_tokens": 2048}), "max_tokens"),
    (_body(thinking={"type": "enabled", "budget_tokens": 10}), "thinking.budget_tokens"),
    (_body(thinking={"type": "deep"}), "thinking.type"),
    (_body(thinking=1.5), "thinking"),  # the schema fuzzer's find: a 500 (the union's tag read `.type`)
    (_body(thinking=["enabled"]), "thinking"),
    (_body(metadata={"user_id": 5}), "metadata.user_id"),
    (_body(mcp_servers=[{"type": "url", "url": "http://x", "name": "x"}]), "mcp_servers"),
    (_body(output_config={"format": {"type": "json_schema"}}), "output_config.format.schema"),
    (json.dumps(_body(messages=[{"role": "user", "content": "\ud800"}])).encode(), "messages.0"),  # a lone surrogate
]  # fmt: skip


@pytest.mark.parametrize(("body", "field"), MALFORMED, ids=[f"{i}-{f}" for i, (_, f) in enumerate(MALFORMED)])
def test_a_malformed_request_is_a_400_naming_its_field(server, body, field):
    if isinstance(body, dict) and "model" in body:
        body = {**body, "model": server.model}
    message = anthropic_error(post(server, body, headers={"content-type": "application/json"}), 400,
                              "invalid_request_error")  # fmt: skip
    assert message.startswith(f"{field}:") or message.startswith(f"{field}."), message


@pytest.mark.parametrize(
    ("raw", "word"),
    [(b"{not json", "JSON"), (b"[1, 2]", "object"), (b"", "object"), (b'"text"', "object")],
)
def test_a_body_that_is_no_json_object_is_anthropics_400(server, raw, word):
    r = post(server, raw, headers={"content-type": "application/json"})
    assert word in anthropic_error(r, 400, "invalid_request_error")


def test_count_tokens_errors_are_anthropics_too(server):
    r = post(server, {"model": server.model, "messages": [{"role": "user", "content": 3}]},
             path="/v1/messages/count_tokens")  # fmt: skip
    assert anthropic_error(r, 400, "invalid_request_error").startswith("messages.0.content")


def test_an_unknown_model_is_anthropics_404(server, client):
    with pytest.raises(anthropic.NotFoundError) as caught:
        client.messages.create(model="claude-nonesuch", max_tokens=1, messages=HI)
    assert caught.value.body["error"]["type"] == "not_found_error"
    r = post(server, {"model": "claude-nonesuch", "messages": HI}, path="/v1/messages/count_tokens")
    assert "claude-nonesuch" in anthropic_error(r, 404, "not_found_error")


def test_an_unknown_path_under_messages_is_anthropics_404(server):
    r = post(server, {}, path="/v1/messages/batches")
    assert r.status_code in (404, 405)
    assert r.json()["type"] == "error" and r.json()["error"]["type"] in ("not_found_error", "invalid_request_error")


def test_a_body_over_the_limit_is_anthropics_413(server):
    r = post(server, {"model": server.model, "max_tokens": 1, "messages": [{"role": "user", "content": "x" * 300_000}]})
    assert "exceeds" in anthropic_error(r, 413, "request_too_large")


def test_a_prompt_longer_than_the_context_is_anthropics_prompt_too_long(server, client):
    words = " ".join(f"w{i}" for i in range(3000))  # more tokens than the tiny model's 2048
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(model=server.model, max_tokens=4, messages=[{"role": "user", "content": words}])
    message = caught.value.body["error"]["message"]
    assert caught.value.body["error"]["type"] == "invalid_request_error"
    assert message.startswith("prompt is too long: ") and message.endswith(" tokens > 2048 maximum"), message


def test_a_full_server_is_a_529_overloaded_with_retry_after(server):
    server.runner.refuse = True
    try:
        r = post(server, {"model": server.model, "max_tokens": 1, "messages": HI})
    finally:
        server.runner.refuse = False
    anthropic_error(r, 529, "overloaded_error")
    assert r.headers["retry-after"] == "3"


def test_a_fault_after_the_stream_started_is_an_error_event(server):
    server.runner.fail = True
    try:
        r = post(server, {"model": server.model, "max_tokens": 8, "stream": True, "messages": HI})
    finally:
        server.runner.fail = False
    assert r.status_code == 200
    events = [line.split(": ", 1)[1] for line in r.text.splitlines() if line.startswith("event: ")]
    assert events[0] == "message_start" and events[-1] == "error", events
    data = json.loads(r.text.strip().splitlines()[-1].removeprefix("data: "))
    assert data["type"] == "error" and data["error"]["type"] == "api_error", data
