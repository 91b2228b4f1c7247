"""Turn type and conversation from what agent runtimes already send (server/turn_inference.py): the
table's rows, the X-OpenAlice-* headers and metadata overriding them, and the sidecar saying where
each came from, in the turn span and the reply's `speculation`, plain and streamed."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from locations import REPO
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from stand_ins.engines import tiny_engine
from support.live_server import LiveServer

from openalice_runner.providers.config import load_routing_text
from openalice_runner.runner import Runner
from openalice_runner.server.app import ServerSettings, create_app
from openalice_runner.server.context import turn_context
from openalice_runner.server.turn_inference import infer_turn_type, tool_kind
from openalice_runner.server.validation import ServerChatRequest
from openalice_runner.tracing import RunnerTelemetry

LOOPS = Path("/work/shared/workloads/agent-loops.jsonl")
TOOLS = [
    {"type": "function", "function": {"name": n, "parameters": {"type": "object", "properties": {}}}}
    for n in ("read_file", "search_docs", "run_sql", "get_weather")
]
USER = {"role": "user", "content": "Look into it."}


def _call(name: str, call_id: str = "c1") -> dict:
    return {"role": "assistant", "tool_calls": [
        {"id": call_id, "type": "function", "function": {"name": name, "arguments": "{}"}}]}  # fmt: skip


def _req(messages, **kw) -> ServerChatRequest:
    return ServerChatRequest.model_validate({"messages": messages, **kw})


@pytest.mark.parametrize(
    ("body", "turn_type", "row"),
    [
        ({"messages": [USER]}, "chat", "default"),
        ({"messages": [USER], "tools": TOOLS}, "chat", "default"),
        ({"messages": [USER], "tools": TOOLS, "tool_choice": "required"}, "tool_call", "forced_tool"),
        ({"messages": [USER], "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "run_sql"}}},
         "tool_call", "forced_tool"),
        ({"messages": [USER], "tools": TOOLS, "tool_choice": {"type": "allowed_tools", "allowed_tools": {
            "mode": "required", "tools": [{"type": "function", "function": {"name": "run_sql"}}]}}},
         "tool_call", "forced_tool"),
        ({"messages": [USER], "response_format": {"type": "json_object"}}, "tool_call", "structured_output"),
        ({"messages": [USER], "tools": TOOLS, "tool_choice": "auto"}, "chat", "default"),
        ({"messages": [USER, _call("read_file"), {"role": "tool", "tool_call_id": "c1", "content": "x = 1"}],
          "tools": TOOLS}, "code_edit", "tool_result"),
        ({"messages": [USER, _call("search_docs"), {"role": "tool", "tool_call_id": "c1", "content": "hits"}],
          "tools": TOOLS}, "rag", "tool_result"),
        ({"messages": [USER, _call("run_sql"), {"role": "tool", "tool_call_id": "c1", "content": "3 rows"}],
          "tools": TOOLS}, "summarize", "tool_result"),
        ({"messages": [USER, _call("read_file"), {"role": "tool", "tool_call_id": "c1", "content": "x = 1"},
                       {"role": "assistant", "content": "Done."}, {"role": "user", "content": "Rename x."}],
          "tools": TOOLS}, "code_edit", "follow_up_on_tools"),
        ({"messages": [USER, {"role": "assistant", "content": "Plan..."},
                       {"role": "user", "content": "Summarise the final plan as a short bullet list."}]},
         "summarize", "summary_asked"),
        # a forced call after a tool result is a tool call (the row above the tool result's)
        ({"messages": [USER, _call("run_sql"), {"role": "tool", "tool_call_id": "c1", "content": "3 rows"}],
          "tools": TOOLS, "tool_choice": "required"}, "tool_call", "forced_tool"),
    ],
)  # fmt: skip
def test_the_table(body, turn_type, row):
    inferred = infer_turn_type(_req(**body))
    assert (inferred.turn_type, inferred.row) == (turn_type, row)


@pytest.mark.parametrize(
    ("name", "kind"),
    [("read_file", "code_edit"), ("Edit", "code_edit"), ("MultiEdit", "code_edit"), ("apply_patch", "code_edit"),
     ("write", "code_edit"), ("TodoWrite", "summarize"), ("update_plan", "summarize"), ("search_docs", "rag"),
     ("WebFetch", "rag"), ("Grep", "rag"), ("shell", "summarize"), ("Bash", "summarize"),
     ("run_command", "summarize"), ("get_weather", "summarize")],
)  # fmt: skip
def test_the_tool_kinds_of_the_runtimes_tools(name, kind):
    assert tool_kind(name) == kind


def test_headers_and_metadata_override_what_is_inferred():
    request = _req([USER], tools=TOOLS, tool_choice="required", user="u-1", prompt_cache_key="conv-9")
    tc = turn_context({}, None, request)
    assert (tc.turn_type, tc.turn_type_source, tc.turn_type_row) == ("tool_call", "inferred", "forced_tool")
    assert (tc.conversation_id, tc.conversation_source) == ("conv-9", "inferred")  # prompt_cache_key before user
    tc = turn_context({"x-openalice-turn-type": "rag", "x-openalice-conversation-id": "c"}, None, request)
    assert (tc.turn_type, tc.turn_type_source, tc.conversation_id, tc.conversation_source) == (
        "rag", "stated", "c", "stated")
    tc = turn_context({}, {"turn_type": "summarize"}, request)
    assert (tc.turn_type, tc.turn_type_source) == ("summarize", "stated")
    assert turn_context({}, None, _req([USER], user="u-1")).conversation_id == "u-1"
    tc = turn_context({}, None, _req([USER]), session="claude-session-1")  # a wire's own session key
    assert (tc.conversation_id, tc.conversation_source) == ("claude-session-1", "inferred")
    tc = turn_context({}, None, _req([USER]))
    assert tc.conversation_id is None and tc.conversation_source is None
    # a session key that could not be an id is no conversation, never a 400 the caller could not foresee
    assert turn_context({}, None, _req([USER], user="x" * 1000)).conversation_id is None


def _loop_requests():
    """Each call of agent-loops.jsonl as the loop sends it (replies: the expected call, else a line of
    text), with the turn type the workload states for it."""
    for line in LOOPS.read_text().splitlines():
        loop = json.loads(line)
        messages, last_id = list(loop["messages"]), None
        for i, step in enumerate(loop["steps"]):
            if "call" in step:
                call = step["call"]
                body = {"messages": list(messages), "max_tokens": call["max_tokens"]}
                if loop["tools"]:
                    body["tools"] = loop["tools"]
                if call.get("tool_choice") is not None:
                    body["tool_choice"] = call["tool_choice"]
                yield loop["id"], call["turn_type"], _req(**body)
                following = loop["steps"][i + 1] if i + 1 < len(loop["steps"]) else {}
                if "tool_result" in following:
                    last_id = f"call_{i}"
                    expected = call["expect_tool_call"]
                    messages.append({"role": "assistant", "tool_calls": [{"id": last_id, "type": "function", "function": {
                        "name": expected["name"], "arguments": json.dumps(expected["arguments"])}}]})  # fmt: skip
                else:
                    messages.append({"role": "assistant", "content": "A reply."})
            elif "tool_result" in step:
                messages.append({"role": "tool", "tool_call_id": last_id, "content": step["tool_result"]})
            else:
                messages.append({"role": "user", "content": step["user"]})


COPY_HEAVY = {"tool_call", "code_edit", "summarize", "rag"}  # one class in every shipped policy's rules


@pytest.mark.skipif(not LOOPS.exists(), reason=f"{LOOPS} is not here")
def test_the_agent_loops_turn_types_are_inferred_as_the_workload_states_them():
    calls = list(_loop_requests())
    assert len(calls) >= 20
    same = [(cid, stated, infer_turn_type(r).turn_type) for cid, stated, r in calls]
    exact = sum(stated == inferred for _, stated, inferred in same)
    assert exact / len(same) >= 0.9, [s for s in same if s[1] != s[2]]
    # every call lands in the class of rules its stated type does (chat vs copy-heavy)
    assert [(c, s, i) for c, s, i in same if (s in COPY_HEAVY) != (i in COPY_HEAVY)] == []


PROVIDERS = """
providers:
  local: {type: local, tiny_random: true, max_tokens_default: 4}
routes:
  - {name: default, chain: [local]}
"""


@pytest.fixture(scope="module")
def server():
    spans = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
    telemetry = RunnerTelemetry(tracer_provider)
    runner = Runner.from_config(providers=load_routing_text(PROVIDERS), policy=False, telemetry=telemetry,
                                engine=tiny_engine())  # fmt: skip
    live = LiveServer(create_app(runner, telemetry=telemetry, settings=ServerSettings())).start()
    live.spans = spans
    yield live
    live.stop()


def _turn_spans(server):
    return [s for s in server.spans.get_finished_spans() if s.name.startswith("invoke_agent")]


TOOL_RESULT = [USER, _call("search_docs"), {"role": "tool", "tool_call_id": "c1", "content": "hits"}]


def test_a_runtimes_request_is_inferred_and_says_so(server):
    server.spans.clear()
    body = {"messages": TOOL_RESULT, "tools": TOOLS, "max_tokens": 2, "prompt_cache_key": "sess-1"}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    spec = r.json()["speculation"]
    assert (spec["turn_type"], spec["turn_type_source"], spec["conversation_source"]) == ("rag", "inferred", "inferred")
    [turn] = _turn_spans(server)
    assert turn.attributes["openalice.turn.type"] == "rag"
    assert turn.attributes["gen_ai.conversation.id"] == "sess-1"
    assert turn.attributes["openalice.turn.type.source"] == "inferred"
    assert turn.attributes["openalice.turn.type.inferred_by"] == "tool_result"
    assert turn.attributes["openalice.conversation.source"] == "inferred"


def test_stated_headers_win_and_say_so_in_a_stream(server):
    server.spans.clear()
    body = {"messages": TOOL_RESULT, "tools": TOOLS, "max_tokens": 2, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    headers = {"X-OpenAlice-Turn-Type": "summarize", "X-OpenAlice-Conversation-Id": "conv-2"}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, headers=headers, timeout=60) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    spec = events[-1]["speculation"]
    assert (spec["turn_type"], spec["turn_type_source"], spec["conversation_source"]) == (
        "summarize", "stated", "stated")
    [turn] = _turn_spans(server)
    assert turn.attributes["openalice.turn.type.source"] == "stated"
    assert "openalice.turn.type.inferred_by" not in turn.attributes


def test_opencodes_session_header_is_its_conversation(server):
    server.spans.clear()
    body = {"messages": [USER], "max_tokens": 2}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, headers={"x-session-id": "ses_1"}, timeout=60)
    assert r.json()["speculation"]["conversation_source"] == "inferred"
    [turn] = _turn_spans(server)
    assert turn.attributes["gen_ai.conversation.id"] == "ses_1"


def test_no_conversation_says_none(server):
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": [USER], "max_tokens": 2}, timeout=60)
    spec = r.json()["speculation"]
    assert (spec["turn_type"], spec["turn_type_source"], spec["conversation_source"]) == ("chat", "inferred", None)


@pytest.mark.skipif(not LOOPS.exists(), reason=f"{LOOPS} is not here")
@pytest.mark.parametrize("policy_file", sorted((REPO / "policies").glob("*.yaml")),
                         ids=lambda p: p.name)  # fmt: skip
def test_every_shipped_policy_decides_the_agent_loops_alike_inferred_or_stated(policy_file):
    """What the speed of inferred turn types hangs on: the rule each call gets. For every call of
    agent-loops.jsonl, at every batch size the rules name and every provider they name, the rule the
    inferred turn type matches is the one the stated type matches (the adaptive γ is kept per turn
    type, so `auto` rules may still pick another γ while they learn)."""
    from openalice_runner.policies.loader import load_policy_file
    from openalice_runner.policies.plan import CompiledPolicy, RequestContext

    loaded = load_policy_file(policy_file)
    policy = CompiledPolicy(loaded.policy, loaded.version)
    providers = {None, "local"} | {p for r in policy.rules for p in r.providers or ()}
    differ = []
    for cid, stated, request in _loop_requests():
        inferred = infer_turn_type(request).turn_type
        for batch in (1, 2, 3, 4, 5, 8, 9, 16, 17, 32, 33, 64):
            for provider in providers:
                a = policy.match(RequestContext(stated, batch, provider)).name
                b = policy.match(RequestContext(inferred, batch, provider)).name
                if a != b:
                    differ.append((cid, stated, inferred, batch, provider, a, b))
    assert differ == []


def _model(server) -> str:
    return httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"][0]["id"]


def test_claude_codes_requests_on_the_messages_wire_are_inferred_and_clamped(server):
    """A Claude Code call as it comes: no X-OpenAlice-* header, its session header, the newest input a
    tool result of its Read tool: a code_edit turn in the session's conversation, with the budget in
    x-openalice-max-tokens (the clamp itself is the provider's, whatever the wire: server/test_context_budget.py;
    a clamped budget here would have the tiny random model write ~1,900 tokens)."""
    server.spans.clear()
    body = {
        "model": _model(server), "max_tokens": 4,
        "tools": [{"name": "Read", "input_schema": {"type": "object", "properties": {"file_path": {"type": "string"}}}}],
        "messages": [
            {"role": "user", "content": "Fix a.py"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "Read",
                                               "input": {"file_path": "a.py"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "x = 1"}]},
        ],
    }  # fmt: skip
    headers = {"x-api-key": "k", "anthropic-version": "2023-06-01", "x-claude-code-session-id": "cc-session-1"}
    r = httpx.post(f"{server.url}/v1/messages", json=body, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["type"] == "message"
    assert r.headers["x-openalice-max-tokens"] == "4"
    [turn] = _turn_spans(server)
    assert turn.attributes["openalice.turn.type"] == "code_edit"
    assert turn.attributes["openalice.turn.type.source"] == "inferred"
    assert turn.attributes["gen_ai.conversation.id"] == "cc-session-1"
    assert turn.attributes["openalice.conversation.inferred_from"] == "x-claude-code-session-id"


def test_codexs_requests_on_the_responses_wire_are_inferred(server):
    server.spans.clear()
    body = {
        "model": _model(server), "max_output_tokens": 4, "prompt_cache_key": "codex-thread-1",
        "tools": [{"type": "function", "name": "shell", "parameters": {"type": "object", "properties": {}}}],
        "input": [
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "List files"}]},
            {"type": "function_call", "call_id": "call_1", "name": "shell", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "a.py b.py"},
        ],
    }  # fmt: skip
    r = httpx.post(f"{server.url}/v1/responses", json=body, timeout=60)
    assert r.status_code == 200, r.text
    [turn] = _turn_spans(server)
    assert turn.attributes["openalice.turn.type"] == "summarize"  # a shell's output: summarised
    assert turn.attributes["openalice.turn.type.inferred_by"] == "tool_result"
    assert turn.attributes["gen_ai.conversation.id"] == "codex-thread-1"
    assert turn.attributes["openalice.conversation.inferred_from"] == "prompt_cache_key"
