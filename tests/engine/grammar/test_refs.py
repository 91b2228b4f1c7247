"""Issue 46, finding 9: a schema's `$ref`s are bounded before anything compiles it (how many, chains
of aliases, the depth with every `$ref` followed), as a 400 naming the field; schemas that use `$ref`
the usual ways pass. Torch-free: the request types alone."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from openalice_runner.types import ChatRequest

HI = [{"role": "user", "content": "hi"}]


def def_chain(n: int) -> dict:
    """The probe's schema: n definitions, each an object whose one required property is the next."""
    defs = {f"d{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}}, "required": ["x"]}
            for i in range(n)}  # fmt: skip
    defs[f"d{n}"] = {"type": "integer"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def alias_chain(n: int) -> dict:
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "integer"}
    return {"type": "object", "$defs": defs, "properties": {"v": {"$ref": "#/$defs/d0"}}}


def refused(body: dict, param: str) -> str:
    with pytest.raises(ValidationError) as caught:
        ChatRequest.model_validate({"model": "m", "messages": HI, **body})
    errors = caught.value.errors()
    assert len(errors) == 1 and ".".join(str(p) for p in errors[0]["loc"]) == param, errors
    return errors[0]["msg"]


def as_format(schema: dict) -> dict:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}


def as_tool(schema: dict) -> dict:
    return {"tools": [{"type": "function", "function": {"name": "f", "parameters": schema}}]}


FORMAT = "response_format.json_schema.schema"
TOOL = "tools.0.function.parameters"


@pytest.mark.parametrize(("schema", "words"), [
    (def_chain(1_000), "more than 1000 $refs"),  # the probe's: a SIGSEGV in the grammar compiler
    (alias_chain(5_000), "more than 1000 $refs"),  # the probe's second
    (def_chain(200), "more than 512 levels deep where its $refs are followed"),  # 201 refs: the depth
    (alias_chain(40), "chain of more than 32 $refs"),
    ({"type": "object", "$defs": {"U": {"enum": [1]}},
      "properties": {f"p{i}": {"$ref": "#/$defs/U"} for i in range(1_001)}}, "more than 1000 $refs"),
])  # fmt: skip
def test_ref_chains_past_the_limits_are_refused_naming_the_field(schema, words):
    assert words in refused(as_format(schema), FORMAT)
    assert words in refused(as_tool({"type": "object", **schema}), TOOL)


def test_a_cycle_of_aliases_is_refused_as_never_reaching_a_value():
    cycle = {"type": "object", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
             "properties": {"v": {"$ref": "#/$defs/a"}}}  # fmt: skip
    assert "no JSON value satisfies the schema" in refused(as_tool(cycle), TOOL)


@pytest.mark.parametrize("schema", [
    def_chain(100),
    alias_chain(30),
    # pydantic's usual output: models in $defs, Optional fields as anyOf, a recursive model
    {"$defs": {"Unit": {"enum": ["c", "f"]},
               "Node": {"type": "object", "properties": {
                   "name": {"type": "string"},
                   "children": {"type": "array", "items": {"$ref": "#/$defs/Node"}},
                   "unit": {"anyOf": [{"$ref": "#/$defs/Unit"}, {"type": "null"}]}}}},
     "type": "object", "properties": {"root": {"$ref": "#/$defs/Node"}, "unit": {"$ref": "#/$defs/Unit"}}},
    # a DAG that doubles at each of 30 levels: many paths, each short
    {"type": "object", "$defs": {**{f"d{i}": {"type": "object", "properties": {
        "a": {"$ref": f"#/$defs/d{i + 1}"}, "b": {"$ref": f"#/$defs/d{i + 1}"}}} for i in range(30)},
        "d30": {"type": "integer"}}, "properties": {"v": {"$ref": "#/$defs/d0"}}},
    {"type": "object", "properties": {"a": {"type": "string"}, "b": {"$ref": "#/properties/a"}}},
])  # fmt: skip
def test_refs_within_the_limits_pass(schema):
    passes(schema)


def passes(schema: dict) -> None:
    ChatRequest.model_validate({"model": "m", "messages": HI, **as_format(schema)})
    ChatRequest.model_validate({"model": "m", "messages": HI, **as_tool({"type": "object", **schema})})


def test_a_cycle_counts_each_schema_on_it_once():
    """Objects on a cycle of $refs count once each, so a recursive schema is as deep as its cycle
    is long: a ring of n definitions, each referring to the next, passes while the ring fits."""

    def ring(n: int) -> dict:
        defs = {f"r{i}": {"type": "object", "properties": {"next": {"$ref": f"#/$defs/r{(i + 1) % n}"}}}
                for i in range(n)}  # fmt: skip
        return {"$defs": defs, "$ref": "#/$defs/r0"}

    passes(ring(100))  # 100 x 3 levels: within 512
    assert "more than 512 levels deep" in refused(as_format(ring(200)), FORMAT)
