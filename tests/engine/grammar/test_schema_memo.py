"""Tool schemas an agent loop resends on every call are meta-schema checked once: the check's
result is remembered by the schema's canonical JSON, and only a pass is remembered."""

from __future__ import annotations

import jsonschema
import pytest

from openalice_runner.types import check_json_schema

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
           "required": ["city"]}  # fmt: skip


@pytest.fixture
def checks(monkeypatch):
    """The schemas jsonschema's meta-schema check was run on."""
    seen: list[dict] = []
    real = jsonschema.Draft202012Validator.check_schema.__func__

    def counting(cls, schema, *args, **kwargs):
        seen.append(schema)
        return real(cls, schema, *args, **kwargs)

    monkeypatch.setattr(jsonschema.Draft202012Validator, "check_schema", classmethod(counting))
    return seen


def test_a_schema_that_passed_is_not_checked_again(checks):
    schema = {**WEATHER, "description": "memo-test-1"}
    assert check_json_schema(schema) is schema
    reordered = dict(reversed(list(schema.items())))  # the same JSON with its keys in another order
    assert check_json_schema(reordered) is reordered
    assert checks == [schema]


def test_a_different_schema_is_checked(checks):
    check_json_schema({**WEATHER, "description": "memo-test-2"})
    check_json_schema({**WEATHER, "description": "memo-test-3"})
    assert len(checks) == 2


def test_a_failing_schema_fails_every_time(checks):
    bad = {"type": "object", "properties": {"city": {"type": 7}}, "description": "memo-test-4"}
    for _ in range(2):
        with pytest.raises(ValueError, match="not a valid JSON Schema"):
            check_json_schema(bad)
    assert len(checks) == 2


def test_limits_are_checked_before_the_memo():
    deep: dict = {"type": "object"}
    for _ in range(100):
        deep = {"type": "object", "properties": {"x": deep}}
    for _ in range(2):
        with pytest.raises(ValueError, match="nested more than"):
            check_json_schema(deep)
