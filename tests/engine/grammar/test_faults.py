"""Issue 46, findings 6, 12 and 13, on the embedded engine's tiny random model.

6: a compiled grammar found in error (llguidance's shared lexer poisoned: injected here) is the
   library's state, not the schema: compiled again and served, a 500 where the fresh one is in error
   too, and never remembered as the schema's failure.
12: time spent waiting for a compile worker is not compile time; a compile past the time bound is
   cancelled (its checker process killed), so what comes next does not wait behind it; a timeout is
   never remembered as the schema's fault.
13: a tool whose parameters use local `$defs`/`$ref` (pydantic's output) can be called: a forced
   call parses and its arguments validate against the tool's schema.
"""

from __future__ import annotations

import json
import threading

import jsonschema
import pytest
from support.tiny_stack import HI, Stack, openai_error

from openalice_runner.engine import grammar as grammar_module
from openalice_runner.engine.grammar import Grammar, GrammarError, json_grammar
from openalice_runner.schema_limits import COMPILE


@pytest.fixture(scope="module")
def stack():
    s = Stack()
    yield s
    s.server.stop()


@pytest.fixture
def compiler(stack):
    return stack.runner.providers["local"].engine.grammars


def ask(stack, schema: dict, max_tokens: int = 16):
    return stack.post({"messages": HI, "max_tokens": max_tokens,
                       "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}})  # fmt: skip


def wide(n: int, tag: str) -> dict:
    """n required string properties: a compile that takes a while (seconds at 10,000)."""
    names = [f"{tag}{i}" for i in range(n)]
    return {"type": "object", "properties": {k: {"type": "string"} for k in names}, "required": names}


# ---------------------------------------------------------------- 6: a poisoned grammar


class Poisoned:
    """A matcher whose shared lexer failed (llguidance: one copy failing can poison the others)."""

    def __init__(self, matcher) -> None:
        self._matcher = matcher

    def is_error(self) -> bool:
        return True

    def get_error(self) -> str:
        return "lexer error: poisoned (injected)"

    def __getattr__(self, name):
        return getattr(self._matcher, name)


def poison_cached(compiler, word: str) -> None:
    text = next(t for t in compiler._cache if word in t)
    compiler._cache[text] = Grammar(text, Poisoned(compiler._cache[text]._template), compiler)


def test_a_poisoned_grammar_is_compiled_again_and_never_blamed_on_the_schema(stack, compiler):
    schema = {"type": "object", "properties": {"poison6": {"type": "integer"}}, "required": ["poison6"]}
    assert ask(stack, schema).status_code == 200  # compiled, cached
    poison_cached(compiler, "poison6")
    for _ in range(2):  # was: 400 GrammarError, then refused from the failures remembered
        r = ask(stack, schema)
        assert r.status_code == 200, r.text
        json.loads(r.json()["choices"][0]["message"]["content"])


def test_a_grammar_in_error_again_on_a_fresh_compile_is_a_500_not_remembered(stack, compiler, monkeypatch):
    schema = {"type": "object", "properties": {"poison6b": {"type": "integer"}}, "required": ["poison6b"]}
    assert ask(stack, schema).status_code == 200
    real = getattr(grammar_module, "build_matcher", None)
    monkeypatch.setattr(grammar_module, "build_matcher", lambda *a, **k: Poisoned(real(*a, **k)), raising=False)
    poison_cached(compiler, "poison6b")
    err = openai_error(ask(stack, schema), 500)
    assert err["code"] == "internal_error" and err["type"] == "server_error", err  # ours, and says so
    monkeypatch.setattr(grammar_module, "build_matcher", real)  # the library recovers
    r = ask(stack, schema)
    assert r.status_code == 200, r.text


# ---------------------------------------------------------------- 12: timeouts


def test_time_waiting_for_a_compile_worker_is_not_compile_time(compiler, monkeypatch):
    release = threading.Event()
    blockers = [compiler._pool.submit(release.wait) for _ in range(2)]  # both workers busy
    monkeypatch.setattr(COMPILE, "timeout_s", 0.2)
    text = json_grammar({"type": "object", "properties": {"queued12": {"type": "integer"}}})
    outcome: list = []
    done = threading.Event()

    def compile_it():
        try:
            outcome.append(compiler.compile(text))
        except Exception as exc:  # noqa: BLE001 - the test reports it
            outcome.append(exc)
        finally:
            done.set()

    threading.Thread(target=compile_it, daemon=True).start()
    try:
        # Ten times the bound in the queue: was refused as grammar_timeout after 0.2 s
        assert not done.wait(2.0), outcome
    finally:
        monkeypatch.setattr(COMPILE, "timeout_s", 30.0)  # what the compile itself gets, once it starts
        release.set()
    assert done.wait(120) and isinstance(outcome[0], Grammar), outcome
    assert all(b.done() for b in blockers)


def test_compiles_waiting_past_the_queue_bounds_are_refused_as_overload(compiler, monkeypatch):
    from openalice_runner.engine.types import EngineOverloaded

    release = threading.Event()
    blockers = [compiler._pool.submit(release.wait) for _ in range(2)]
    try:
        monkeypatch.setattr(COMPILE, "queue_timeout_s", 0.1)
        with pytest.raises(EngineOverloaded, match="no grammar compile worker was free"):  # 429, Retry-After
            compiler.compile(json_grammar({"type": "object", "properties": {"busy12": {"type": "integer"}}}))
        monkeypatch.setattr(COMPILE, "max_queued", 0)
        with pytest.raises(EngineOverloaded, match="already wait"):
            compiler.compile(json_grammar({"type": "object", "properties": {"busy12b": {"type": "integer"}}}))
    finally:
        release.set()
    assert all(b.result(timeout=60) for b in blockers)
    assert compiler._queued == 0


def test_a_compile_that_timed_out_is_not_remembered(compiler, monkeypatch):
    text = json_grammar(wide(3_000, "again12_"))
    monkeypatch.setattr(COMPILE, "timeout_s", 0.01)
    with pytest.raises(GrammarError) as caught:
        compiler.compile(text)
    assert caught.value.code == "grammar_timeout" and "--grammar-timeout" in str(caught.value)
    monkeypatch.setattr(COMPILE, "timeout_s", 120.0)
    assert isinstance(compiler.compile(text), Grammar)  # was: refused again from the failures remembered


def test_a_compile_that_timed_out_is_cancelled_and_nothing_waits_behind_it(compiler, monkeypatch):
    monkeypatch.setattr(COMPILE, "timeout_s", 0.05)
    for n in range(3):  # each ~7 s of llguidance's time here, were it left to run
        with pytest.raises(GrammarError) as caught:
            compiler.compile(json_grammar(wide(10_000, f"slow12_{n}_")))
        assert caught.value.code == "grammar_timeout"
    # Was: queued behind the three (two still running, one waiting), and refused as grammar_timeout.
    monkeypatch.setattr(COMPILE, "timeout_s", 3.0)
    assert isinstance(compiler.compile(json_grammar({"type": "object", "properties": {"next12": {"type": "string"}}})),
                      Grammar)  # fmt: skip
    # the checkers that ran the three were killed with them; the one live now checked the last
    assert sum(child.proc is not None for child in compiler.children) <= 1


# ---------------------------------------------------------------- 13: local $refs in tool parameters


UNITS = {  # pydantic's shape: models and enums in $defs, referred to from the properties
    "type": "object",
    "$defs": {
        "Unit": {"enum": ["c", "f"], "type": "string"},
        "Place": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                  "required": ["city"]},  # fmt: skip
    },
    "properties": {"unit": {"$ref": "#/$defs/Unit"}, "place": {"$ref": "#/$defs/Place"}},
    "required": ["unit", "place"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": UNITS}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "$defs": {"Zone": {"enum": ["utc", "local"]}},
        "properties": {"zone": {"$ref": "#/$defs/Zone"}}, "required": ["zone"]}}},
]  # fmt: skip


@pytest.mark.parametrize("choice", [{"type": "function", "function": {"name": "get_weather"}}, "required"])
@pytest.mark.parametrize("tools", [TOOLS[:1], TOOLS], ids=["one tool", "two tools"])
def test_a_tool_whose_parameters_use_local_refs_is_called_and_its_arguments_validate(stack, choice, tools):
    r = stack.post({"messages": HI, "tools": tools, "tool_choice": choice, "parallel_tool_calls": False,
                    "max_tokens": 96})  # fmt: skip
    assert r.status_code == 200, r.text  # was: 400 "Pointer '/$defs/Unit' does not exist"
    calls = r.json()["choices"][0]["message"]["tool_calls"]
    assert len(calls) == 1, r.json()
    schema = next(t["function"]["parameters"] for t in tools if t["function"]["name"] == calls[0]["function"]["name"])
    jsonschema.validate(json.loads(calls[0]["function"]["arguments"]), schema)


def test_a_tool_with_local_refs_in_auto_mode_compiles(stack):
    r = stack.post({"messages": HI, "tools": TOOLS, "tool_choice": "auto", "max_tokens": 8})
    assert r.status_code == 200, r.text
