"""Budget-aware closing (engine/closing.py): a grammar-constrained reply ends valid within max_tokens.

The closing search on nested schemas (arrays, enums, required keys, anyOf, a call cut inside its
string) from mid-reply states; replies of a random model (it fills free strings until the budget)
that parse and validate at small budgets, the same tokens with and without speculation, serial and
batched; the local provider refusing a budget below the schema's minimum, naming both numbers,
and returning a closed call as tool_calls (plain and streamed, fragments joining into JSON).
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from openalice_runner.engine import Engine, SamplingParams, SpecConfig
from openalice_runner.engine.closing import closing_path, shortest_reply
from openalice_runner.engine.grammar import json_grammar, tool_call_grammar
from openalice_runner.providers.embedded.tool_format import parse_tool_calls

NESTED = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 2},
        "tags": {"type": "array", "items": {"enum": ["red", "green"]}, "minItems": 1},
        "items": {"type": "array", "items": {
            "type": "object",
            "properties": {"kind": {"enum": ["a", "bb"]}, "n": {"type": "integer", "minimum": 10}},
            "required": ["kind", "n"],
        }},
        "pick": {"anyOf": [{"type": "integer"},
                           {"type": "object", "properties": {"x": {"type": "boolean"}}, "required": ["x"]}]},
        "note": {"type": "string"},
    },
    "required": ["name", "tags", "items", "pick"],
}
STOCK = {"type": "function", "function": {"name": "get_stock_price", "parameters": {
    "type": "object", "properties": {"symbol": {"type": "string"}}, "required": ["symbol"]}}}


@pytest.fixture(scope="module")
def engines():
    return [Engine.tiny_random(seed=0, max_batch=1), Engine.tiny_random(seed=0, max_batch=4)]


def _closed(engine, text: str, prefix: str) -> tuple[str, list[int]]:
    constraint = engine.grammars.compile(text).constraint()
    constraint.advance(engine.encode(prefix))
    path = closing_path(constraint, 512)
    assert path is not None
    assert constraint.accepting is (path == [])  # the matcher is back where it was
    return prefix + engine.tokenizer.decode(path), path


@pytest.mark.parametrize("prefix", [
    "",
    '{"name": "Al',  # inside a string
    '{"name": "Alice", "tags": ["re',  # inside an enum, inside an array
    '{"name": "Alice", "tags": ["red"], "items": [{"kind": "bb", "n": 1',  # an integer below its minimum
    '{"name": "x1", "tags": ["green"], "items": [], "pick": {"x"',  # the anyOf's object branch, cut at its key
    '{"name": "x1", "tags": ["green", "red"], "items": [{"kind": "a", "n": 10}, {"kind": "',
])
def test_closing_a_nested_schema_validates(engines, prefix):
    text, path = _closed(engines[0], json_grammar(NESTED), prefix)
    jsonschema.validate(json.loads(text), NESTED)
    assert len(path) <= 40


def test_missing_required_keys_get_their_shortest_values(engines):
    text, _ = _closed(engines[0], json_grammar(NESTED), '{"name": "Alice"')
    value = json.loads(text)
    assert value == {"name": "Alice", "tags": ["green"], "items": [], "pick": 0}  # enum by the search's order
    text, _ = _closed(engines[0], json_grammar(NESTED), "")
    assert json.loads(text)["name"] == "aa"  # minLength 2


def test_closing_a_call_cut_inside_its_string(engines):
    text, path = _closed(engines[0], tool_call_grammar([STOCK], "required", parallel=False),
                         '<tool_call>\n{"name": "get_stock_price", "arguments": {"symbol": "Microsoft.Soccer.Fantasy')
    parsed = parse_tool_calls(text, {"get_stock_price"})
    assert parsed.content is None and len(parsed.tool_calls) == 1
    assert json.loads(parsed.tool_calls[0].function.arguments) == {"symbol": "Microsoft.Soccer.Fantasy"}
    assert len(path) <= 8


def test_shortest_reply_of_a_grammar(engines):
    engine = engines[0]
    grammar = engine.grammars.compile(tool_call_grammar([STOCK], "required", parallel=False))
    full = shortest_reply(grammar, 64)
    after = shortest_reply(grammar.after(engine.encode('<tool_call>\n{"name": "')), 64)
    assert full is not None and after is not None and 10 <= after < full <= 40
    assert shortest_reply(engine.grammars.compile(tool_call_grammar([STOCK], "auto")), 64) == 0  # text may end


SPECS = [
    SpecConfig(method="off", forced_drafts=False),
    SpecConfig(method="off"),
    SpecConfig(method="ngram", gamma=4, adaptive_length=False),
    SpecConfig(method="draft", gamma=3, draft_layers=1),
]
FREE_STRINGS = {"type": "object", "properties": {"title": {"type": "string"}, "tags": {
    "type": "array", "items": {"type": "string"}}}, "required": ["title", "tags"]}


@pytest.mark.parametrize("extra", [0, 3, 30])
@pytest.mark.parametrize("kind", ["json_schema", "required"])
def test_greedy_replies_close_within_the_budget_the_same_with_and_without_speculation(engines, kind, extra):
    """max_tokens: the shortest reply's length and `extra` tokens more."""
    text = json_grammar(FREE_STRINGS) if kind == "json_schema" else tool_call_grammar([STOCK], "required", False)
    reference = None
    for engine in engines:
        grammar = engine.grammars.compile(text)
        max_tokens = shortest_reply(grammar, 64) + extra
        prompt = engine.encode("Write the title of a long book about the sea, the sea, the sea")
        for spec in SPECS:
            out = engine.generate(prompt, SamplingParams(max_tokens=max_tokens), spec, grammar=grammar)
            if reference is None:
                reference = out
            assert out.token_ids == reference.token_ids, (engine.max_batch, spec)
            assert len(out.token_ids) <= max_tokens
    if kind == "json_schema":
        jsonschema.validate(json.loads(reference.text), FREE_STRINGS)
    else:
        parsed = parse_tool_calls(reference.text, {"get_stock_price"})
        assert parsed.content is None and len(parsed.tool_calls) == 1, reference.text
    if reference.finish_reason == "length":
        assert reference.stats.closing > 0  # a random model runs its strings to the budget


def test_sampled_replies_close_within_the_budget(engines):
    for engine in engines:
        grammar = engine.grammars.compile(json_grammar(FREE_STRINGS))
        prompt = engine.encode("A title:")
        for seed in range(6):
            sampling = SamplingParams(temperature=1.0, seed=seed, max_tokens=24)
            out = engine.generate(prompt, sampling, SpecConfig(method="ngram", gamma=3), grammar=grammar)
            jsonschema.validate(json.loads(out.text), FREE_STRINGS)
            assert len(out.token_ids) <= 24


# ---- the local provider: refused at admission, or closed and returned as tool_calls ------------------


def _provider(engine):
    from openalice_runner.providers.local import EmbeddedConfig, EmbeddedProvider

    return EmbeddedProvider("local", EmbeddedConfig.model_validate({"type": "local"}), engine=engine)


def _call_request(max_tokens: int, **kw):
    from openalice_runner.types import ChatRequest

    return ChatRequest(messages=[{"role": "user", "content": "Check MSFT for me"}], tools=[STOCK],
                       max_tokens=max_tokens, **kw)


async def test_a_budget_below_the_schema_minimum_is_refused_naming_both_numbers(engines):
    from openalice_runner.providers.base import CallContext, ProviderBadRequest
    from openalice_runner.types import ChatRequest

    engine = engines[0]
    need = shortest_reply(engine.grammars.compile(tool_call_grammar([STOCK], "required", False))
                          .after(engine.encode('<tool_call>\n{"name": "')), 64)
    provider = _provider(engine)
    for request in (_call_request(need - 1, tool_choice="required", parallel_tool_calls=False),
                    ChatRequest(messages=[{"role": "user", "content": "A record"}], max_tokens=3,
                                response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": NESTED}})):
        with pytest.raises(ProviderBadRequest) as info:
            await provider.chat(request, CallContext())
        assert info.value.param == "max_tokens"
        assert f"max_tokens is {request.max_tokens}, below the minimum the schema needs" in str(info.value)
    assert f"takes {need} tokens" in str(await _refusal(provider, _call_request(need - 1, tool_choice="required",
                                                                                  parallel_tool_calls=False)))
    ok = await provider.chat(_call_request(need, tool_choice="required", parallel_tool_calls=False), CallContext())
    assert ok.tool_calls and ok.content is None  # the minimum itself is enough


async def _refusal(provider, request):
    from openalice_runner.providers.base import CallContext, ProviderBadRequest

    try:
        await provider.chat(request, CallContext())
    except ProviderBadRequest as exc:
        return exc
    raise AssertionError("not refused")


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_stock_price"}}, "auto"])
async def test_a_call_cut_by_the_budget_comes_back_closed_as_tool_calls(engines, choice):
    from stand_ins.streams import joined_tool_calls, read_all

    from openalice_runner.providers.base import CallContext

    provider = _provider(engines[1])
    request = _call_request(30, tool_choice=choice)
    reply = await provider.chat(request, CallContext())
    if choice == "auto" and not reply.tool_calls:
        assert "<tool_call>" not in (reply.content or "")  # text, never a call's markup
        return
    assert reply.content is None and len(reply.tool_calls) == 1
    arguments = json.loads(reply.tool_calls[0].function.arguments)
    assert isinstance(arguments["symbol"], str)
    if reply.finish_reason == "length":
        assert reply.speculation.closing
    chunks = await read_all(provider.stream(request, CallContext()))
    calls = joined_tool_calls(chunks)
    assert len(calls) == 1 and json.loads(calls[0]["arguments"]) == arguments  # fragments join into the JSON
    assert not "".join(c.delta_text for c in chunks)
    assert chunks[-1].finish_reason == reply.finish_reason


async def test_an_allowed_tools_call_cut_by_the_budget_closes_on_an_allowed_tool(engines):
    """`allowed_tools` required: both tools offered, only one allowed; from the grammar's shortest
    reply up, a budget that cuts the call still gives one closed call to the allowed tool; below it,
    a 400 at admission naming max_tokens."""
    from openalice_runner.providers.base import CallContext, ProviderBadRequest
    from openalice_runner.types import ChatRequest

    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    choice = {"type": "allowed_tools",
              "allowed_tools": {"mode": "required", "tools": [{"type": "function", "function": {"name": "get_stock_price"}}]}}
    provider = _provider(engines[1])

    def request(budget: int) -> ChatRequest:
        return ChatRequest(messages=[{"role": "user", "content": "Check MSFT for me"}], tools=[weather, STOCK],
                           tool_choice=choice, max_tokens=budget)

    with pytest.raises(ProviderBadRequest) as refused:
        await provider.chat(request(8), CallContext())
    need = int(re.search(r"takes (\d+) tokens", str(refused.value))[1])  # the grammar's shortest reply here
    assert refused.value.param == "max_tokens" and need > 8
    with pytest.raises(ProviderBadRequest):
        await provider.chat(request(need - 1), CallContext())
    for budget in (need, need + 8):
        reply = await provider.chat(request(budget), CallContext())
        assert reply.content is None and len(reply.tool_calls) == 1, reply
        assert reply.tool_calls[0].function.name == "get_stock_price"
        assert isinstance(json.loads(reply.tool_calls[0].function.arguments)["symbol"], str)
        assert reply.usage.completion_tokens <= budget
