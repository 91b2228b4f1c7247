"""Issue 34, finding 3: a grammar that failed is never served as if it compiled; `$ref` cycles,
unsatisfiable schemas and keywords llguidance does not enforce are a 400 naming the field; a compile
past --grammar-timeout is a 400. Over real HTTP, the embedded engine's tiny random model."""

from __future__ import annotations

import pytest
from support.tiny_stack import HI, Stack, openai_error

from openalice_runner.schema_limits import COMPILE

SCHEMA_PARAM = "response_format.json_schema.schema"


@pytest.fixture(scope="module")
def stack():
    s = Stack()
    yield s
    s.server.stop()


def fmt(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


def ask(stack, schema: dict, *, stream: bool = False, **extra):
    return stack.post({"messages": HI, "response_format": fmt(schema), "max_tokens": 8, "stream": stream, **extra})


def test_a_grammar_that_failed_fails_again_instead_of_answering_empty(stack):
    schema = {"type": "object", "properties": {"a": {"type": "string", "pattern": "^(b{1000}){1000}$"}},
              "required": ["a"]}  # fmt: skip
    for stream in (False, True, False):  # the second and third used to be 200 with content ""
        err = openai_error(ask(stack, schema, stream=stream), 400)
        assert err["param"] == SCHEMA_PARAM and "lexer error" in err["message"], err


@pytest.mark.parametrize(
    "schema",
    [
        {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
        {"$ref": "#"},
        {"type": "object", "properties": {"x": {"$ref": "#/properties/x"}}, "required": ["x"]},
    ],
)
def test_a_ref_cycle_that_never_reaches_a_value_is_a_400(stack, schema):
    err = openai_error(ask(stack, schema), 400)
    assert err["param"] == SCHEMA_PARAM and "no JSON value satisfies the schema" in err["message"], err


def test_a_recursive_schema_that_reaches_values_still_works(stack):
    tree = {"$defs": {"n": {"type": "object", "properties": {"k": {"type": "array", "items": {"$ref": "#/$defs/n"}}}}},
            "$ref": "#/$defs/n"}  # fmt: skip
    assert ask(stack, tree).status_code == 200


@pytest.mark.parametrize(("schema", "word"), [({"not": {}}, '"not"'), ({"type": "string", "format": "weird"}, "weird")])
def test_keywords_the_grammar_does_not_enforce_are_refused_by_name(stack, schema, word):
    err = openai_error(ask(stack, schema), 400)
    assert err["param"] == SCHEMA_PARAM and word in err["message"], err
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": schema}, "required": ["a"]}}}  # fmt: skip
    err = openai_error(stack.post({"messages": HI, "tools": [tool], "tool_choice": "required", "max_tokens": 8}), 400)
    assert err["param"] == "tools[0].function.parameters" and word in err["message"], err


def test_a_compile_past_the_grammar_timeout_is_a_400_each_time(stack, monkeypatch):
    monkeypatch.setattr(COMPILE, "timeout_s", 0.01)
    wide = {"type": "object", "properties": {f"q{i}": {"type": "string"} for i in range(5_000)},
            "required": [f"q{i}" for i in range(5_000)]}  # fmt: skip
    for _ in range(2):
        err = openai_error(ask(stack, wide), 400)
        assert err["param"] == SCHEMA_PARAM and err["code"] == "grammar_timeout", err
        assert "--grammar-timeout" in err["message"]


def test_a_schema_past_the_grammar_backends_limits_is_a_400_not_a_500(stack):
    # 1,000 optional keys: llguidance's parser stops at its 2,000 items in a row once the object opens
    wide = {"type": "object", "properties": {f"k{i}": {"type": "integer"} for i in range(1_000)}}
    err = openai_error(ask(stack, wide), 400)
    assert err["param"] == SCHEMA_PARAM and "past the grammar backend's limits" in err["message"], err


def test_the_grammar_cache_is_bounded_by_its_grammars_text(stack):
    """Memory: a compiled grammar holds ~80 bytes per character of its text, so the cache counts
    text, not entries (64 large schemas once held 1.6 GB); past the bound the oldest go."""
    from openalice_runner.engine.grammar import json_grammar

    compiler = stack.runner.providers["local"].engine.grammars
    texts = [json_grammar({"type": "object", "properties": {f"v{n}_{i}": {"type": "integer"} for i in range(300)}})
             for n in range(6)]  # fmt: skip
    bound = 3 * len(texts[0])
    compiler.cache_chars, before = bound, compiler.cache_chars
    try:
        for text in texts:
            compiler.compile(text)
        held = sum(len(t) for t in compiler._cache)
        assert held <= bound and texts[-1] in compiler._cache and texts[0] not in compiler._cache
        assert compiler._cached_chars == held
    finally:
        compiler.cache_chars = before
