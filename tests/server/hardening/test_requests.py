"""Issue 34, findings 2, 5 and 7 (request side), over real HTTP on loopback with the embedded
engine's tiny random model: deep schemas are a 400 naming the field and the limit, never a 500;
unexpected errors are one log line with a request id (a traceback once per distinct error);
/health answers while a large schema is validated and compiled; seed and stream are checked."""

from __future__ import annotations

import threading

import httpx
import pytest
import structlog
from support.tiny_stack import HI, Stack, openai_error

from openalice_runner.server.error_log import ErrorLog


@pytest.fixture(scope="module")
def stack():
    s = Stack()
    yield s
    s.server.stop()


def nested_objects(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def nested_any_of(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"anyOf": [schema, {"type": "null"}]}
    return schema


def tool(parameters: dict, name: str = "f") -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


# ---- 2: deep schemas


@pytest.mark.parametrize("depth", [100, 400])
def test_deeply_nested_tool_parameters_are_a_400_naming_the_field_and_the_limit(stack, depth):
    err = openai_error(stack.post({"messages": HI, "tools": [tool({"type": "object"}), tool(nested_objects(depth), "g")]}), 400)
    assert err["param"] == "tools[1].function.parameters" and err["code"] == "invalid_value", err
    assert "nested more than 64 levels deep" in err["message"]


def test_deeply_nested_any_of_in_response_format_is_a_400(stack):
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": nested_any_of(80)}}
    err = openai_error(stack.post({"messages": HI, "response_format": fmt}), 400)
    assert err["param"] == "response_format.json_schema.schema" and "64 levels" in err["message"], err


def test_a_schema_with_too_many_values_is_a_400(stack):
    wide = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(30_000)}}
    err = openai_error(stack.post({"messages": HI, "tools": [tool(wide)]}), 400)
    assert err["param"] == "tools[0].function.parameters" and "more than 50000 JSON values" in err["message"], err


def test_a_json_body_nested_too_deep_is_a_400(stack):
    raw = b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    err = openai_error(stack.post(raw), 400)
    assert err["code"] in ("invalid_json", "invalid_value", "invalid_body"), err


def test_responses_carry_a_request_id(stack):
    r = stack.post({"messages": HI, "max_tokens": 1})
    assert r.status_code == 200 and len(r.headers["x-request-id"]) == 16
    assert r.headers["x-request-id"] != stack.post({"messages": HI, "max_tokens": 1}).headers["x-request-id"]


def _raise(kind: type[Exception], message: str) -> Exception:
    try:
        raise kind(message)
    except Exception as exc:
        return exc


class _Clock:
    """A monotonic clock that moves only when the test moves it (the error log's rate runs on it)."""

    def __init__(self) -> None:
        self.now = 1024.0  # steps of 1/8 s stay exact in binary

    def monotonic(self) -> float:
        return self.now


def test_unexpected_errors_are_one_line_each_and_a_traceback_once_per_kind(monkeypatch):
    from openalice_runner.server import error_log

    clock = _Clock()
    monkeypatch.setattr(error_log, "time", clock)  # no refill while the burst is spent, whatever the machine's speed
    errors = ErrorLog(lines_per_s=5.0, burst=10)
    with structlog.testing.capture_logs() as logged:
        written = sum(errors.report("request failed", _raise(RecursionError, "deep")) for _ in range(200))
        errors.report("request failed", _raise(KeyError, "other"))
    assert written == 10  # the burst, and nothing more while the clock stands
    with_traceback = [e for e in logged if "exc_info" in e]
    assert [e["error_type"] for e in with_traceback] == ["RecursionError"]  # the KeyError was over the rate
    assert all("request_id" in e and "where" in e for e in logged if "exc_info" not in e)
    clock.now += 0.125  # 0.625 of a line at 5 lines/s: still nothing
    assert not errors.report("request failed", _raise(KeyError, "other"))
    clock.now += 0.125  # the bucket refilled past one line
    with structlog.testing.capture_logs() as logged:
        assert errors.report("request failed", _raise(KeyError, "other"))
    assert logged[0]["error_type"] == "KeyError" and "exc_info" in logged[0] and logged[0]["suppressed"] == 192


# ---- 5: validating and compiling a large schema does not stall /health


def test_health_answers_while_a_large_schema_is_validated_and_compiled(stack, monkeypatch):
    """The request's schema check (jsonschema's meta-schema, ~2 s for a large schema) and its grammar
    compile used to run on the event loop, and /health waited for them. Each is held here until
    /health has answered while it runs: on the loop, /health could not answer and the test fails."""
    from openalice_runner.engine.grammar import GrammarCompiler
    from openalice_runner.types import tools as types  # where the validators look check_json_schema up

    wide = {"type": "object", "properties": {f"q{i}": {"type": "string"} for i in range(200)},
            "required": [f"q{i}" for i in range(200)]}  # fmt: skip
    held = {name: (threading.Event(), threading.Event()) for name in ("validating", "compiling")}  # entered, answered

    def holding(name, fn, mine):
        def held_call(*args, **kwargs):
            if mine(*args):
                entered, answered = held[name]
                entered.set()
                # bounded: on the loop nothing can answer /health, and the test fails below instead of hanging
                answered.wait(60)
            return fn(*args, **kwargs)

        return held_call

    monkeypatch.setattr(types, "check_json_schema",
                        holding("validating", types.check_json_schema, lambda schema: schema is not None
                                and "q199" in schema.get("properties", {})))  # fmt: skip
    monkeypatch.setattr(GrammarCompiler, "compile",
                        holding("compiling", GrammarCompiler.compile, lambda self, text: "q199" in text))
    out: dict = {}

    def big():
        fmt = {"type": "json_schema", "json_schema": {"name": "wide", "schema": wide}}
        r = stack.post({"messages": HI, "response_format": fmt, "max_tokens": 2})
        out.update(status=r.status_code, body=r.text[:300])

    thread = threading.Thread(target=big, daemon=True)
    with httpx.Client(base_url=stack.url, timeout=10) as client:
        assert client.get("/health").status_code == 200
        thread.start()
        for name, (entered, answered) in held.items():
            assert entered.wait(60), f"the request never reached {name}"
            assert client.get("/health").status_code == 200, name  # answered while the request is held there
            answered.set()
    thread.join(60)
    assert out.get("status") == 200, out


# ---- 7: seed and stream


@pytest.mark.parametrize("seed", [2**80, 2**64, -1])
def test_seed_outside_uint64_is_refused(stack, seed):
    err = openai_error(stack.post({"messages": HI, "seed": seed, "max_tokens": 1}), 400)
    assert err["param"] == "seed", err


def test_seed_at_the_uint64_bounds_is_accepted(stack):
    for seed in (0, 2**64 - 1):
        assert stack.post({"messages": HI, "seed": seed, "max_tokens": 1}).status_code == 200


@pytest.mark.parametrize("value", ["yes", "true", 1, "false"])
def test_stream_must_be_a_real_boolean(stack, value):
    err = openai_error(stack.post({"messages": HI, "stream": value, "max_tokens": 1}), 400)
    assert err["param"] == "stream" and "boolean" in err["message"], err


async def test_an_unexpected_error_is_answered_and_not_reraised_for_uvicorn_to_log_again():
    """Starlette re-raises after its handler answered; uvicorn then logged the whole traceback of
    every 500 a second time. The guard ends it: one rate-limited line, and the 500 JSON."""
    from fastapi import FastAPI

    from openalice_runner.server.errors import install_error_handlers
    from openalice_runner.server.guard import GuardMiddleware
    from openalice_runner.server.metrics import ServerMetrics

    app = FastAPI()
    install_error_handlers(app)
    app.add_middleware(GuardMiddleware, api_key=None, max_body_bytes=1024, metrics=ServerMetrics())

    @app.get("/boom")
    async def boom():
        raise RecursionError("maximum recursion depth exceeded")

    transport = httpx.ASGITransport(app=app, raise_app_exceptions=True)  # an exception out of the app fails here
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        with structlog.testing.capture_logs() as logged:
            r = await client.get("/boom")
    assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error"
    errors = [e for e in logged if e["log_level"] == "error"]
    assert len(errors) == 1 and errors[0]["request_id"] == r.headers["x-request-id"], errors
