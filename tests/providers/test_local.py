"""Local provider: the embedded engine (tiny random model) and, for exact tool-call text, a scripted engine."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest
from stand_ins.engines import tiny_engine
from stand_ins.scripted_engine import ScriptedEngine
from stand_ins.streams import joined_tool_calls, read_all

from openalice_runner.providers.base import CallContext, ProviderBadRequest, ProviderRateLimited
from openalice_runner.providers.embedded import tool_format
from openalice_runner.providers.local import EmbeddedConfig, EmbeddedProvider, sampling_params
from openalice_runner.speculation import SpeculationPlan
from openalice_runner.types import ChatRequest

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
    },
]


def local(engine, **kw) -> EmbeddedProvider:
    return EmbeddedProvider("local", EmbeddedConfig.model_validate({"type": "local", **kw}), engine=engine)


def decision(method="ngram", gamma=4, **options):
    return SpeculationPlan(method, gamma, rule="r", policy_version="v", options=options)


async def test_chat_with_the_tiny_model():
    engine = tiny_engine()
    p = local(engine)
    req = ChatRequest(messages=[{"role": "user", "content": "hi"}], max_tokens=5)
    r = await p.chat(req, CallContext(plan=decision()))
    direct = engine.generate(
        engine.render_chat([{"role": "user", "content": "hi"}]), sampling_params(req.sampling)
    )
    assert r.content == direct.text and r.model == "tiny-random" and r.provider == "local"
    assert r.usage.completion_tokens == 5 and r.finish_reason == "length"
    assert r.speculation.method == "ngram" and r.speculation.gamma == 4
    assert (r.speculation.rule, r.speculation.policy_version) == ("r", "v")
    assert r.outcome.rule == "r"  # the outcome for the policy's observe
    assert p.load().batch_size == 0


async def test_stream_with_the_tiny_model_matches_chat():
    p = local(tiny_engine())
    req = ChatRequest(messages=[{"role": "user", "content": "hello"}], max_tokens=6)
    full = await p.chat(req, CallContext())
    chunks = await read_all(p.stream(req, CallContext()))
    assert "".join(c.delta_text for c in chunks) == full.content
    assert chunks[-1].finish_reason == "length" and chunks[-1].usage.completion_tokens == 6
    assert chunks[0].delta.role == "assistant"


async def test_eagle_without_a_usable_head_runs_without_speculation(caplog):
    p = local(tiny_engine())
    with caplog.at_level("WARNING", logger="openalice_runner.providers.local"):
        for _ in range(3):
            r = await p.chat(
                ChatRequest(messages=[{"role": "user", "content": "x"}], max_tokens=2),
                CallContext(plan=decision("eagle")),
            )
            assert r.speculation.method == "off"  # what ran, honestly
    assert len([m for m in caplog.messages if "eagle head not usable" in m]) == 1  # said once


async def test_eagle_decision_drafts_with_the_policys_head(tmp_path):
    from stand_ins.eagle_heads import build_tiny_head

    engine = tiny_engine()
    folder, _, _ = build_tiny_head(engine, tmp_path, None)
    chosen = decision("eagle", 3, eagle_head=str(folder), eagle_lookup=True)
    req = ChatRequest(messages=[{"role": "user", "content": "one two three one two three one two"}], max_tokens=12)
    r = await local(engine).chat(req, CallContext(plan=chosen))
    plain = await local(engine).chat(req, CallContext())
    assert r.speculation.method == "eagle" and r.speculation.proposed
    assert r.content == plain.content


async def test_follow_up_call_reports_its_cached_prompt_tokens():
    p = local(None, tiny_random=True)  # the provider's own engine: prefix reuse is on by default
    history = [{"role": "user", "content": "Tell me about the lazy dog and the quick brown fox."}]
    first = await p.chat(ChatRequest(messages=history, max_tokens=6), CallContext())
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    history += [{"role": "assistant", "content": first.content}, {"role": "user", "content": "And then?"}]
    second = await p.chat(ChatRequest(messages=history, max_tokens=6), CallContext())
    # the first prompt at least (its last token may merge with the reply once rendered as text)
    assert first.usage.prompt_tokens - 1 <= second.usage.prompt_tokens_details.cached_tokens < second.usage.prompt_tokens
    assert second.model_dump()["usage"]["prompt_tokens_details"] == {
        "cached_tokens": second.usage.prompt_tokens_details.cached_tokens}


async def test_context_too_long_is_a_bad_request():
    p = local(tiny_engine())
    long = "word " * 3000
    with pytest.raises(ProviderBadRequest):
        await p.chat(ChatRequest(messages=[{"role": "user", "content": long}], max_tokens=2), CallContext())
    assert p.load().batch_size == 0


async def test_valid_tool_calls_become_tool_calls():
    text = 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    engine = ScriptedEngine(text)
    p = local(engine)
    r = await p.chat(
        ChatRequest(messages=[{"role": "user", "content": "weather?"}], tools=TOOLS), CallContext()
    )
    assert r.finish_reason == "tool_calls" and r.content == "Checking."
    assert [c.function.name for c in r.tool_calls] == ["get_weather", "get_time"]
    assert json.loads(r.tool_calls[0].function.arguments) == {"city": "Paris"}
    # SmolLM2's template renders no tools: the fallback system block is in the prompt.
    prompt = engine.tokenizer.decode(engine.prompts[0])
    assert "<tools>" in prompt and '"name": "get_weather"' in prompt


async def test_malformed_tool_call_is_content_not_an_error():
    text = '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>'
    r = await local(ScriptedEngine(text)).chat(
        ChatRequest(messages=[{"role": "user", "content": "x"}], tools=TOOLS), CallContext()
    )
    assert r.tool_calls == [] and r.content == text and r.finish_reason == "stop"


async def test_named_tool_choice_prefills_and_stops_at_the_close_tag():
    engine = ScriptedEngine('Lima"}}\n')
    p = local(engine)
    req = ChatRequest(
        messages=[{"role": "user", "content": "Lima?"}],
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    r = await p.chat(req, CallContext())
    assert r.tool_calls[0].function.name == "get_weather" and json.loads(
        r.tool_calls[0].function.arguments
    ) == {"city": "Lima"}
    prompt = engine.tokenizer.decode(engine.prompts[0])
    assert prompt.endswith(
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "'
    )
    assert "</tool_call>" in engine.calls[0][0].stop


async def test_tool_choice_none_lists_the_tools_states_the_rule_and_parses_nothing():
    """The tools stay in the prompt (its prefix does not depend on tool_choice, as for OpenAI);
    the rule is the final turn's last line, and the grammar allows no call."""
    engine = ScriptedEngine('<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    req = ChatRequest(messages=[{"role": "user", "content": "x"}], tools=TOOLS, tool_choice="none")
    r = await local(engine).chat(req, CallContext())
    assert r.tool_calls == []  # what the scripted engine says is content: nothing is parsed
    prompt = engine.tokenizer.decode(engine.prompts[0])
    assert "<tools>" in prompt and '"name": "get_weather"' in prompt
    assert prompt.endswith(f"x\n\n{tool_format.RULE_NONE}<|im_end|>\n<|im_start|>assistant\n")
    (grammar,) = engine.grammars_used
    assert grammar.constraint().walk(engine.encode("Sunny, 17 degrees."))[0] == len(engine.encode("Sunny, 17 degrees."))
    n, _ = grammar.constraint().walk(engine.encode("Let me check. <tool_call>"))
    assert n < len(engine.encode("Let me check. <tool_call>"))


async def test_tools_and_rules_reach_a_template_that_renders_tools_alike():
    """A template that renders tools gets them for every tool_choice, like the fallback form; the
    rule of "none" is its final turn's last line, "required" and a named function pre-fill."""
    rendered = []

    class ToolTemplateEngine(ScriptedEngine):
        def render_chat(self, messages, tools=None):
            rendered.append((messages, tools))
            return super().render_chat(messages)

    engine = ToolTemplateEngine("Sunny.")
    p = local(engine)
    p._template_tools = True  # as for a template whose Jinja source uses `tools`
    user = {"role": "user", "content": "x"}
    for choice in ("auto", "required", {"type": "function", "function": {"name": "get_time"}}, "none"):
        await p.chat(ChatRequest(messages=[user], tools=TOOLS, tool_choice=choice), CallContext())
    assert [tools for _, tools in rendered] == [TOOLS] * 4
    assert [messages for messages, _ in rendered[:3]] == [[user]] * 3
    assert rendered[3][0] == [{"role": "user", "content": f"x\n\n{tool_format.RULE_NONE}"}]
    prompts = [engine.tokenizer.decode(ids) for ids in engine.prompts]
    assert prompts[1].endswith('<tool_call>\n{"name": "') and prompts[2].endswith('{"name": "get_time", "arguments": ')


async def test_stream_holds_back_tool_calls_and_streams_text():
    """A call block that strays from the grammar's layout (here no newline after the tag, from an
    engine that ignored the grammar) is held back and parsed at the end, as without a grammar."""
    pieces = ["Sure", ", one moment <tool", '_call>{"name": "get_time", ', '"arguments": {}}</tool_call>']
    engine = ScriptedEngine("".join(pieces), pieces)
    chunks = await read_all(
        local(engine).stream(
            ChatRequest(messages=[{"role": "user", "content": "t?"}], tools=TOOLS), CallContext()
        )
    )
    text = "".join(c.delta_text for c in chunks)
    assert "<tool" not in text and text.startswith("Sure, one moment")
    (call,) = [d for c in chunks for d in c.tool_call_deltas]
    assert call.function.name == "get_time" and call.function.arguments == "{}" and call.id
    assert chunks[-1].finish_reason == "tool_calls"


async def test_stream_passes_lookalike_text_through():
    pieces = ["a < b", " and <tool", "box> done"]
    engine = ScriptedEngine("".join(pieces), pieces)
    chunks = await read_all(
        local(engine).stream(
            ChatRequest(messages=[{"role": "user", "content": "x"}], tools=TOOLS), CallContext()
        )
    )
    assert "".join(c.delta_text for c in chunks) == "a < b and <toolbox> done"
    assert chunks[-1].finish_reason == "stop"


PLAN_TOOL = {"type": "function", "function": {"name": "plan_trip", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "number"}},
    "required": ["city", "days"]}}}  # fmt: skip


def _grammar_allows(engine, text):
    """The scripted reply is one the request's grammar allows: the stand-in writes nothing the
    engine could not (GrammarError otherwise)."""
    assert engine.grammars_used[-1] is not None
    engine.grammars_used[-1].after(engine.encode(text))


async def test_stream_sends_a_call_while_it_is_written():
    """Grammar-constrained: a call's first delta (id, name) goes out once its arguments open, before
    the rest is written; its fragments join up to exactly the unstreamed reply's arguments (2.50 is
    2.5 there); parallel calls get indices 0, 1; text before them streams as content."""
    pieces = ["Checking.", "\n<tool_call>\n", '{"name": "plan_', 'trip", "arguments": ', '{"city": "Li',
              'ma", "da', 'ys": 2.50', '}}\n</tool_call>\n<tool_call>\n', '{"name": "get_time", "arguments": {}}',
              "\n</tool_call>"]  # fmt: skip
    text = "".join(pieces)
    engine = ScriptedEngine(text, pieces)
    engine.paced = threading.Semaphore(0)
    req = ChatRequest(messages=[{"role": "user", "content": "plan Lima"}], tools=[PLAN_TOOL, *TOOLS])
    chunks = []
    async with local(engine).stream(req, CallContext()) as stream:
        reading = aiter(stream)
        engine.paced.release(5)  # up to the arguments' opening brace
        while not any(c.tool_call_deltas for c in chunks):
            chunks.append(await asyncio.wait_for(anext(reading), 5))
        written_at_first_delta = engine.yielded
        engine.paced.release(len(pieces) - 5)
        chunks += [c async for c in reading]
    _grammar_allows(engine, text)
    assert written_at_first_delta == 5 < len(pieces)
    whole = await local(ScriptedEngine(text)).chat(req, CallContext())
    calls = joined_tool_calls(chunks)
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c.function.name, c.function.arguments) for c in whole.tool_calls
    ] == [("plan_trip", '{"city": "Lima", "days": 2.5}'), ("get_time", "{}")]
    assert len([c for c in chunks if any(d.index == 0 for d in c.tool_call_deltas)]) >= 4
    assert "".join(c.delta_text for c in chunks).strip() == whole.content == "Checking."
    assert chunks[0].delta.role == "assistant" and chunks[-1].finish_reason == "tool_calls"


async def test_stream_named_tool_choice_sends_the_prefilled_call_from_the_first_piece():
    pieces = ["Li", 'ma"', "}", "}\n"]  # generation stops at the close tag
    text = "".join(pieces)
    engine = ScriptedEngine(text, pieces)
    req = ChatRequest(messages=[{"role": "user", "content": "Lima?"}], tools=TOOLS,
                      tool_choice={"type": "function", "function": {"name": "get_weather"}})  # fmt: skip
    chunks = await read_all(local(engine).stream(req, CallContext()))
    _grammar_allows(engine, text)  # the grammar after the prefill
    whole = await local(ScriptedEngine(text)).chat(req, CallContext())
    assert joined_tool_calls(chunks) == [
        {"id": chunks[0].tool_call_deltas[0].id, "name": "get_weather", "arguments": '{"city": "Lima"}'}
    ] and whole.tool_calls[0].function.arguments == '{"city": "Lima"}'
    fragments = [d.function.arguments for c in chunks for d in c.tool_call_deltas]
    assert fragments == ["", '{"city": "Li', 'ma"', "}"]  # the arguments' brace with the call's own
    assert chunks[-1].finish_reason == "tool_calls"


async def test_stream_cut_inside_a_call_finishes_with_length():
    """max_tokens inside the arguments (an engine that did not close the call): what was streamed
    stays (it cannot be taken back); the finish reason says why; the unstreamed reply never returns
    the cut markup as content (issue 33)."""
    pieces = ["<tool_call>\n", '{"name": "get_weather", ', '"arguments": {"city": "Li']
    text = "".join(pieces)
    engine = ScriptedEngine(text, pieces)
    engine.finish_reason = "length"
    req = ChatRequest(messages=[{"role": "user", "content": "Lima?"}], tools=TOOLS, max_tokens=7)
    chunks = await read_all(local(engine).stream(req, CallContext()))
    _grammar_allows(engine, text)
    assert [(c["name"], c["arguments"]) for c in joined_tool_calls(chunks)] == [("get_weather", '{"city": "Li')]
    assert chunks[-1].finish_reason == "length" and "".join(c.delta_text for c in chunks) == ""
    cut = ScriptedEngine(text)
    cut.finish_reason = "length"
    whole = await local(cut).chat(req, CallContext())
    assert whole.tool_calls == [] and whole.content is None and whole.finish_reason == "length"


async def test_history_with_tool_results_is_rendered():
    engine = ScriptedEngine("It is sunny.")
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny, 21C"},
    ]
    r = await local(engine).chat(ChatRequest(messages=messages), CallContext())  # no tools offered now
    assert r.content == "It is sunny."
    prompt = engine.tokenizer.decode(engine.prompts[0])
    assert "The get_weather tool returned: sunny, 21C" in prompt and '"city": "Paris"' in prompt


async def test_overload_is_refused_early():
    """The admission gate in front of the engine: one running, one queued, the next refused at once."""
    from openalice_runner.providers.wrappers.admission import AdmissionGate, AdmittedProvider

    engine = ScriptedEngine("ok")
    engine.gate = threading.Event()
    p = AdmittedProvider(local(engine), AdmissionGate("local", max_in_flight=1, max_queue=1))
    req = ChatRequest(messages=[{"role": "user", "content": "x"}])
    first = [asyncio.create_task(p.chat(req, CallContext())) for _ in range(2)]
    # the first is in the engine (held at its gate, which waits longer than this test does)
    assert await asyncio.to_thread(engine.entered.wait, 60), "the first call never reached the engine"
    deadline = time.monotonic() + 60  # the second's queue place: a state the gate has no event for
    while (p.load().batch_size, p.load().queue_depth) != (1, 1):
        assert time.monotonic() < deadline and not any(t.done() for t in first), p.load()
        await asyncio.sleep(0.01)
    with pytest.raises(ProviderRateLimited) as info:
        await p.chat(req, CallContext())
    assert info.value.retry_after and info.value.fallback_ok
    engine.gate.set()
    assert [r.content for r in await asyncio.gather(*first)] == ["ok", "ok"]
    assert p.load().batch_size == 0 and p.gate.stats().in_flight == 0


async def test_policy_decides_gamma_again_at_every_engine_step():
    """The policy's batch ranges reach the batching engine per step, not only per request."""
    from openalice_runner.policies import PolicyStore
    from openalice_runner.providers.wrappers.policy import PolicyProvider

    engine = ScriptedEngine("fine")
    store = PolicyStore.from_file("policies/default.yaml")
    provider = PolicyProvider(local(engine), store)
    req = ChatRequest(messages=[{"role": "user", "content": "hi"}], max_tokens=5)
    await provider.chat(req, CallContext(turn_type="code_edit"))
    _, spec = engine.calls[-1]
    table = spec.per_batch
    assert spec.method == "ngram" and table is not None
    assert table.at(1) >= 3  # copy-heavy, small batch: auto γ in [3, 8]
    assert 1 <= table.at(6) <= 4  # mid batch: capped at 4
    assert table.at(9) == 0 and table.at(4 + 8) == 0  # past 8 (running + waiting): no drafts


async def test_local_load_is_the_schedulers_batch_and_queue():
    engine = tiny_engine()
    p = local(engine)
    assert p.load().batch_size == 0
    engine.scheduler._running.append(object())  # as if one sequence were decoding
    try:
        assert (p.load().batch_size, p.load().queue_depth) == (1, 0)
    finally:
        engine.scheduler._running.clear()


class _CountingEngine:
    """The tiny engine, counting the decode rounds it still produces after its cancel event is set."""

    def __init__(self, real) -> None:
        self.real = real
        self.tokenizer, self.model_name = real.tokenizer, real.model_name
        self.rounds_after_cancel = 0
        self.ended = threading.Event()

    def render_chat(self, messages, tools=None):
        return self.real.render_chat(messages, tools)

    def encode(self, text):
        return self.real.encode(text)

    @property
    def grammars(self):
        return self.real.grammars

    def stream(self, prompt_ids, sampling, spec, cancel=None, grammar=None):
        try:
            for event in self.real.stream(prompt_ids, sampling, spec, cancel, grammar=grammar):
                if cancel is not None and cancel.is_set():
                    self.rounds_after_cancel += 1
                yield event
        finally:
            self.ended.set()


async def test_leaving_the_stream_block_stops_the_engine_within_a_round():
    engine = _CountingEngine(tiny_engine())
    p = local(engine)
    req = ChatRequest(messages=[{"role": "user", "content": "count"}], max_tokens=400)
    async with p.stream(req, CallContext()) as chunks:
        await anext(chunks)
    assert await asyncio.to_thread(engine.ended.wait, 30)  # the engine's generator has ended
    assert engine.rounds_after_cancel <= 1 and p.load().batch_size == 0 and p.kv_tokens_in_use == 0


# ---- grammars: tool_choice and response_format enforced on the tiny model -----------------------
CLOSED_TOOLS = [  # closed values only: a random model fills a free string until max_tokens
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"unit": {"enum": ["c", "f"]}, "rain": {"type": "boolean"}},
        "required": ["unit", "rain"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["utc", "local"]}}, "required": ["zone"],
        "additionalProperties": False}}},
]
SHAPE = {"type": "object", "properties": {"ok": {"type": "boolean"}, "kind": {"enum": ["a", "bb"]}},
         "required": ["ok", "kind"], "additionalProperties": False}


@pytest.mark.parametrize("choice", ["required", "named"])
async def test_forced_tool_calls_always_parse_on_the_tiny_model(choice):
    p = local(tiny_engine())
    tool_choice = {"type": "function", "function": {"name": "get_time"}} if choice == "named" else "required"
    for i, stream in enumerate((False, True, False)):
        req = ChatRequest(messages=[{"role": "user", "content": f"question {i}"}], tools=CLOSED_TOOLS,
                          tool_choice=tool_choice, parallel_tool_calls=False, max_tokens=80, temperature=1.0, seed=i)
        if stream:
            chunks = await read_all(p.stream(req, CallContext()))
            calls = joined_tool_calls(chunks)
            finish, forced = chunks[-1].finish_reason, chunks[-1].speculation.forced
            args = [json.loads(c["arguments"]) for c in calls]
            names = [c["name"] for c in calls]
        else:
            r = await p.chat(req, CallContext())
            finish, forced = r.finish_reason, r.speculation.forced
            args = [json.loads(c.function.arguments) for c in r.tool_calls]
            names = [c.function.name for c in r.tool_calls]
        assert finish == "tool_calls" and len(names) == 1  # parallel_tool_calls false: one call
        assert forced > 0
        if choice == "named":
            assert names == ["get_time"] and args[0]["zone"] in ("utc", "local")
        else:
            assert names[0] in ("get_weather", "get_time")


def _allowed(mode: str, *names: str) -> dict:
    tools = [{"type": "function", "function": {"name": n}} for n in names]
    return {"type": "allowed_tools", "allowed_tools": {"mode": mode, "tools": tools}}


@pytest.mark.parametrize("mode", ["required", "auto"])
async def test_allowed_tools_renders_every_tool_and_lets_only_the_allowed_be_called(mode):
    engine = tiny_engine()
    p = local(engine)
    ask = [{"role": "user", "content": "what time is it"}]
    plain = p.build_prompt(ChatRequest(messages=ask, tools=CLOSED_TOOLS, tool_choice=mode))
    allowed = p.build_prompt(ChatRequest(messages=ask, tools=CLOSED_TOOLS, tool_choice=_allowed(mode, "get_time")))
    assert allowed.ids == plain.ids and "get_weather" in engine.tokenizer.decode(allowed.ids)  # the same prompt
    assert allowed.tool_names == {"get_time"} and plain.tool_names == {"get_weather", "get_time"}
    assert '"const": "get_time"' in allowed.grammar.text and "get_weather" not in allowed.grammar.text
    constraint = allowed.grammar.constraint()  # it starts after the prefill
    for call, ok in (('get_time", "arguments": {"zone": "utc"}}\n</tool_call>', True),
                     ('get_weather", "arguments": {"unit": "c", "rain": true}}\n</tool_call>', False)):
        tokens = engine.encode(('<tool_call>\n{"name": "' + call).removeprefix(allowed.prefill))
        assert (constraint.walk(tokens)[0] == len(tokens)) is ok, call  # only the allowed tool can be named
    for i, stream in enumerate((False, True, False)):  # sampled or greedy: only the allowed tool is called
        req = ChatRequest(messages=[{"role": "user", "content": f"question {i}"}], tools=CLOSED_TOOLS,
                          tool_choice=_allowed(mode, "get_time"), parallel_tool_calls=False, max_tokens=60,
                          temperature=0.0 if i == 2 else 1.0, seed=i)
        if stream:
            chunks = await read_all(p.stream(req, CallContext()))
            calls = joined_tool_calls(chunks)
            names, finish = [c["name"] for c in calls], chunks[-1].finish_reason
        else:
            r = await p.chat(req, CallContext())
            names, finish = [c.function.name for c in r.tool_calls], r.finish_reason
        assert set(names) <= {"get_time"}
        if mode == "required":
            assert names == ["get_time"] and finish == "tool_calls"


async def test_response_format_json_schema_and_json_object_parse():
    p = local(tiny_engine())
    for i, fmt in enumerate([{"type": "json_schema", "json_schema": {"name": "shape", "schema": SHAPE, "strict": True}},
                             {"type": "json_object"}]):
        req = ChatRequest(messages=[{"role": "user", "content": "json please"}], response_format=fmt, max_tokens=60,
                          temperature=0.7, seed=i)
        r = await p.chat(req, CallContext())
        if fmt["type"] == "json_schema":
            value = json.loads(r.content)
            assert set(value) == {"ok", "kind"} and value["kind"] in ("a", "bb")
        elif r.finish_reason == "stop":  # a free object from a random model may run to max_tokens
            assert isinstance(json.loads(r.content), dict)
        else:
            assert r.content.startswith("{")


async def test_named_tool_choice_grammar_starts_after_the_prefill():
    engine = ScriptedEngine('Lima"}}\n')
    req = ChatRequest(messages=[{"role": "user", "content": "Lima?"}], tools=TOOLS,
                      tool_choice={"type": "function", "function": {"name": "get_weather"}})
    await local(engine).chat(req, CallContext())
    (grammar,) = engine.grammars_used
    assert '"const": "get_weather"' in grammar.text and "get_time" not in grammar.text
    constraint = grammar.constraint()  # the grammar's state is after `{"city": "`: the value goes on
    n, _ = constraint.walk(engine.encode('Lima"}}\n</tool_call>'))
    assert n == len(engine.encode('Lima"}}\n</tool_call>'))


async def test_schema_the_grammar_backend_refuses_is_a_bad_request_naming_the_tool():
    tools = [CLOSED_TOOLS[0], {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "(?<=x)y"}}}}}]
    req = ChatRequest(messages=[{"role": "user", "content": "x"}], tools=tools)
    with pytest.raises(ProviderBadRequest) as info:
        await local(tiny_engine()).chat(req, CallContext())
    assert info.value.param == "tools[1].function.parameters" and "look-around" in str(info.value)


class _FailingEngine(ScriptedEngine):
    """An engine whose generation raises `fault` before its first piece, plain or streamed."""

    def __init__(self, fault: Exception) -> None:
        super().__init__("never")
        self.fault = fault

    def stream(self, *args, **kwargs):
        raise self.fault

    def generate(self, *args, **kwargs):
        raise self.fault


@pytest.mark.parametrize(
    ("fault", "expected", "status"),
    [
        (RuntimeError("a bug of ours"), "ProviderInternalError", 500),
        (KeyError("a bug of ours"), "ProviderInternalError", 500),
        ("invalid", "ProviderBadRequest", 400),
        ("overloaded", "ProviderRateLimited", None),  # the server maps it to 429
    ],
)
async def test_plain_and_streamed_calls_map_an_engine_fault_alike(fault, expected, status):
    """One error mapping for both paths: the client's faults are 400, ours 500, never raw."""
    from openalice_runner.engine.errors import InvalidRequest
    from openalice_runner.engine.types import EngineOverloaded
    from openalice_runner.providers.base import ProviderError

    if fault == "invalid":
        fault = InvalidRequest("top_p: out of range")
    elif fault == "overloaded":
        fault = EngineOverloaded("the waiting line is full")
    req = ChatRequest(messages=[{"role": "user", "content": "x"}])
    p = local(_FailingEngine(fault))
    with pytest.raises(ProviderError) as plain:
        await p.chat(req, CallContext())
    with pytest.raises(ProviderError) as streamed:
        await read_all(p.stream(req, CallContext()))
    for info in (plain, streamed):
        assert type(info.value).__name__ == expected
        assert info.value.status_code == status
        assert info.value.__cause__ is fault
    assert str(plain.value) == str(streamed.value)
