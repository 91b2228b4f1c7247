"""The OpenAI-shaped types: validation names the field; dumps are what the openai client parses."""

from __future__ import annotations

import openai.types.chat as oai
import pytest
from pydantic import ValidationError

from openalice_runner.types import (
    AllowedToolChoice,
    ChatChunk,
    ChatMessage,
    ChatRequest,
    ChatResult,
    ChunkChoice,
    Delta,
    SpeculationInfo,
    Usage,
)

USER = {"role": "user", "content": "hi"}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}


def _locs(exc: ValidationError) -> list[str]:
    return [".".join(str(p) for p in e["loc"]) for e in exc.errors()]


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"messages": []}, "messages"),
        ({"messages": [USER], "temperature": 3}, "temperature"),
        ({"messages": [USER], "top_p": 0}, "top_p"),
        ({"messages": [USER], "max_tokens": 0}, "max_tokens"),
        ({"messages": [USER], "stop": [""]}, "stop"),
        ({"messages": [USER], "n": 2}, "n"),
        ({"messages": [USER], "temprature": 0.5}, "temprature"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
        (
            {"messages": [USER], "tools": [{"type": "function", "function": {"name": "bad name!"}}]},
            "tools.0.function.name",
        ),
        (
            {"messages": [USER], "tools": [{"type": "function", "function": {
                "name": "f", "parameters": {"type": "object", "properties": 5}}}]},
            "tools.0.function.parameters",
        ),
        ({"messages": [USER], "response_format": {"type": "regex"}}, "response_format.type"),
        ({"messages": [USER], "response_format": {"type": "json_schema"}}, "response_format"),
        (
            {"messages": [USER], "response_format": {"type": "json_schema", "json_schema": {
                "name": "x", "schema": {"type": "object", "properties": 5}}}},
            "response_format.json_schema.schema",
        ),
    ],
)
def test_bad_input_names_the_field(body, field):
    with pytest.raises(ValidationError) as info:
        ChatRequest.model_validate(body)
    assert any(loc.startswith(field) for loc in _locs(info.value)), _locs(info.value)


def test_role_rules_are_reported_with_the_message_index():
    with pytest.raises(ValidationError) as info:
        ChatRequest(messages=[USER, {"role": "tool", "content": "42"}])
    assert "messages.1" in _locs(info.value)
    assert "tool_call_id" in str(info.value)
    with pytest.raises(ValidationError, match="tool_calls is only allowed"):
        ChatMessage(role="user", content="x", tool_calls=[])


def test_tool_choice_must_name_an_offered_tool():
    with pytest.raises(ValidationError, match="not in tools"):
        ChatRequest(
            messages=[USER], tools=[TOOL], tool_choice={"type": "function", "function": {"name": "g"}}
        )
    with pytest.raises(ValidationError, match="tool_choice needs tools"):
        ChatRequest(messages=[USER], tool_choice="required")
    req = ChatRequest(messages=[USER], tools=[TOOL])
    assert req.effective_tool_choice == "auto"
    assert ChatRequest(messages=[USER]).effective_tool_choice == "none"


def _allowed(mode, *names):
    tools = [{"type": "function", "function": {"name": n}} for n in names]
    return {"type": "allowed_tools", "allowed_tools": {"mode": mode, "tools": tools}}


def test_allowed_tools_choice_validates_as_openai_sends_it():
    g = {"type": "function", "function": {"name": "g", "parameters": {"type": "object"}}}
    choice: oai.ChatCompletionAllowedToolChoiceParam = _allowed("required", "g")  # the openai client's shape
    req = ChatRequest(messages=[USER], tools=[TOOL, g], tool_choice=choice)
    assert isinstance(req.tool_choice, AllowedToolChoice) and req.effective_tool_choice is req.tool_choice
    assert req.tool_choice.allowed_tools.mode == "required" and req.tool_choice.allowed_tools.names == ["g"]
    assert req.model_dump(exclude_none=True)["tool_choice"] == choice  # dumps back unchanged
    assert ChatRequest(messages=[USER], tools=[TOOL], tool_choice=_allowed("auto", "f")).tool_choice.allowed_tools.mode == "auto"


@pytest.mark.parametrize(
    ("choice", "where", "words"),
    [
        (_allowed("auto", "f", "h"), "tool_choice.allowed_tools.tools[1].function.name", "'h', which is not in tools"),
        (_allowed("sometimes", "f"), "tool_choice.AllowedToolChoice.allowed_tools.mode", "'auto' or 'required'"),
        (_allowed("auto"), "tool_choice.AllowedToolChoice.allowed_tools.tools", "at least 1 item"),
        ({"type": "allowed_tools"}, "tool_choice.AllowedToolChoice.allowed_tools", "Field required"),
        ({"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [{"type": "function"}]}},
         "tool_choice.AllowedToolChoice.allowed_tools.tools.0.function", "Field required"),
        ("sometimes", "tool_choice.str", "'none', 'auto' or 'required'"),  # one form's error, not every form's
    ],
)  # fmt: skip
def test_bad_allowed_tools_name_the_field(choice, where, words):
    """`where`: the FieldError's param, or pydantic's location (its form tags the sidecar leaves out)."""
    with pytest.raises(ValidationError) as info:
        ChatRequest(messages=[USER], tools=[TOOL], tool_choice=choice)
    (error,) = info.value.errors()
    field_error = (error.get("ctx") or {}).get("error")
    assert (field_error.param if field_error is not None else ".".join(map(str, error["loc"]))) == where, error
    assert words in error["msg"]


def test_openai_client_body_validates():
    body = {
        "model": "x",
        "messages": [
            {"role": "system", "content": "s"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
            },
            {"role": "tool", "tool_call_id": "c", "content": "ok"},
        ],
        "tools": [TOOL],
        "tool_choice": "auto",
        "stop": "END",
        "max_completion_tokens": 12,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    req = ChatRequest.model_validate(body)
    assert req.messages[1].text == "ab"
    assert req.sampling.stop == ["END"] and req.max_tokens == 12
    assert req.message_dicts()[2]["tool_calls"][0]["function"]["name"] == "f"


def test_result_and_chunk_dump_to_openai_shapes():
    res = ChatResult.single(
        model="m",
        content=None,
        tool_calls=[{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
        finish_reason="tool_calls",
        usage=Usage.of(3, 4),
        speculation=SpeculationInfo(method="ngram", gamma=4, proposed=8, accepted=6, acceptance_rate=0.75),
        provider="local",
    )
    data = res.to_openai()
    parsed = oai.ChatCompletion.model_validate(data)
    assert parsed.choices[0].message.tool_calls[0].function.name == "f"
    assert data["speculation"]["acceptance_rate"] == 0.75 and data["provider"] == "local"
    assert "fallback_from" not in data
    assert res.as_message().tool_calls[0].id == "c"

    chunk = ChatChunk(id="x", model="m", choices=[ChunkChoice(delta=Delta(role="assistant", content="he"))])
    parsed_chunk = oai.ChatCompletionChunk.model_validate(chunk.to_openai())
    assert parsed_chunk.choices[0].delta.content == "he"
    assert chunk.delta.content == "he" and chunk.finish_reason is None


def test_engine_sampling_conversion():
    from openalice_runner.providers.local import sampling_params

    s = sampling_params(ChatRequest(
        messages=[USER], temperature=0.7, top_k=20, seed=3, stop="x", max_tokens=9
    ).sampling)
    assert (s.temperature, s.top_k, s.seed, s.stop, s.max_tokens) == (0.7, 20, 3, ("x",), 9)
    assert sampling_params(ChatRequest(messages=[USER]).sampling, default_max_tokens=5).greedy


def test_response_format_shapes_round_trip():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "thing", "schema": schema, "strict": True}}
    req = ChatRequest.model_validate({"messages": [USER], "response_format": fmt})
    assert req.response_format.json_schema.schema_ == schema and req.response_format.to_dict() == fmt
    for plain in ({"type": "text"}, {"type": "json_object"}):
        assert ChatRequest.model_validate({"messages": [USER], "response_format": plain}).response_format.to_dict() == plain
