"""Property-based tests (hypothesis): request models, the routing (provider) schema, the sidecar's
request checks and the admission gate. (The policy schema and the n-gram search have theirs in
policies/test_schema.py and engine/test_ngram.py.)"""

from __future__ import annotations

import asyncio
import contextlib
import json

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from openalice_runner.providers.config import RoutingConfig, RoutingConfigError, load_routing_text
from openalice_runner.providers.wrappers.admission import AdmissionGate, AdmissionRefused
from openalice_runner.server.errors import APIError
from openalice_runner.server.validation import ServerChatRequest, check_request
from openalice_runner.types import ChatRequest

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(10**12), 10**12)
    | st.floats(allow_nan=False)
    | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4)
    ),
    max_leaves=12,
)
roles = st.sampled_from(["system", "developer", "user", "assistant", "tool", "wizard", "", None])
names = st.sampled_from(["get_weather", "read_file", "bad name!", "", "x" * 65])
tool_calls = st.lists(
    st.fixed_dictionaries(
        {"id": st.sampled_from(["c1", "c2", ""]), "type": st.just("function"),
         "function": st.fixed_dictionaries({"name": names, "arguments": st.sampled_from(["{}", '{"a": 1}', "no"])})},
    ),
    max_size=2,
)  # fmt: skip
messages = st.fixed_dictionaries(
    {"role": roles},
    optional={
        "content": st.none() | st.text(max_size=30) | st.lists(
            st.fixed_dictionaries({"type": st.sampled_from(["text", "image"]), "text": st.text(max_size=10)}),
            max_size=2,
        ),
        "tool_calls": tool_calls,
        "tool_call_id": st.sampled_from(["c1", "c2", "zz"]),
        "name": st.text(max_size=8),
    },
)  # fmt: skip
tools = st.lists(
    st.fixed_dictionaries(
        {"type": st.just("function"),
         "function": st.fixed_dictionaries({"name": names}, optional={
             "parameters": st.sampled_from([{"type": "object", "properties": {}}, {"type": "string"}])})},
    ),
    max_size=3,
)  # fmt: skip
bodies = st.fixed_dictionaries(
    {"messages": st.lists(messages, max_size=5)},
    optional={
        "max_tokens": st.integers(-5, 10**7) | json_values,
        "max_completion_tokens": st.integers(-5, 100),
        "temperature": st.floats(-1, 3) | json_values,
        "top_p": st.floats(-1, 2),
        "top_k": st.integers(-2, 50),
        "stop": st.none() | st.text(max_size=5) | st.lists(st.text(max_size=5), max_size=20),
        "tools": tools,
        "tool_choice": st.sampled_from(["none", "auto", "required", "maybe"])
        | st.fixed_dictionaries(
            {"type": st.just("function"), "function": st.fixed_dictionaries({"name": names})}
        ),
        "stream": st.booleans() | json_values,
        "n": st.integers(0, 3),
        "timeout": st.floats(-1, 100) | json_values,
        "metadata": st.dictionaries(st.text(max_size=5), st.text(max_size=5) | st.integers(), max_size=3),
        "bogus": json_values,
    },
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(bodies)
def test_request_bodies_validate_or_raise_a_validation_error_naming_a_field(body):
    """Any body either validates or fails with pydantic's ValidationError (a 400 naming the field at
    the sidecar), never another exception; what validates survives a JSON round trip unchanged."""
    try:
        request = ServerChatRequest.model_validate(body)
    except ValidationError as exc:
        assert exc.errors() and all(err["loc"] or err["type"] for err in exc.errors())
        return
    assert request.messages
    again = ServerChatRequest.model_validate_json(request.model_dump_json(exclude_none=True))
    assert again == request
    # The sidecar's whole-request checks refuse only with a 400 that names a field.
    try:
        check_request(request, max_tokens_limit=4096)
    except APIError as err:
        assert err.status_code == 400 and err.param
    # The plain request model (the Runner's) reads the same body less the sidecar's `timeout`.
    ChatRequest.model_validate(request.model_dump(exclude_none=True, exclude={"timeout"}))


@settings(max_examples=300, deadline=None)
@given(json_values)
def test_any_json_value_as_a_body_is_refused_cleanly(value):
    with contextlib.suppress(ValidationError):
        ServerChatRequest.model_validate(value)


provider_entries = st.one_of(
    st.fixed_dictionaries(
        {"type": st.just("local")},
        optional={"tiny_random": st.booleans(), "dtype": st.sampled_from(["bf16", "fp32", "fp8"]),
                  "max_tokens_default": st.integers(-1, 500), "max_in_flight": st.integers(-1, 4),
                  "max_queue": st.integers(-1, 4), "max_waiting": st.integers(0, 3)},
    ),
    st.fixed_dictionaries(
        {"type": st.just("hosted")},
        optional={"model": st.sampled_from(["openai/x", ""]), "timeout_s": st.floats(-1, 10),
                  "max_retries": st.integers(-1, 12), "max_in_flight": st.integers(0, 3)},
    ),
    st.fixed_dictionaries(
        {"type": st.just("sglang"), "model": st.just("m")},
        optional={"pools": st.dictionaries(st.sampled_from(["e", "n"]), st.fixed_dictionaries(
            {"replicas": st.lists(st.sampled_from(["http://127.0.0.1:1", "ftp://x", "nope"]), max_size=2)},
            optional={"launch": st.fixed_dictionaries({}, optional={
                "algorithm": st.sampled_from(["NONE", "EAGLE3", "NGRAM", "magic"]),
                "draft_model_path": st.just("h"), "adaptive": st.booleans(),
                "num_steps": st.integers(0, 3)})}), max_size=2),
            "default_pool": st.sampled_from(["e", "z"])},
    ),
    st.fixed_dictionaries({"type": st.sampled_from(["gpu", "", "LOCAL"])}),
    json_values,
)  # fmt: skip
routes = st.lists(
    st.fixed_dictionaries(
        {"name": st.sampled_from(["a", "b", "default"]),
         "chain": st.lists(st.sampled_from(["local", "cloud", "gpu", "nowhere"]), max_size=3)},
        optional={"match": st.fixed_dictionaries({}, optional={
            "turn_types": st.lists(st.sampled_from(["chat", "tool_call"]), max_size=2),
            "models": st.lists(st.sampled_from(["m", "n"]), max_size=2)})},
    ),
    max_size=3,
)  # fmt: skip
routing_files = st.fixed_dictionaries(
    {},
    optional={
        "providers": st.dictionaries(
            st.sampled_from(["local", "cloud", "gpu"]), provider_entries, max_size=3
        ),
        "routes": routes | json_values,
        "extra": json_values,
    },
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(routing_files)
def test_routing_files_load_or_report_every_problem_with_a_position(data):
    text = yaml.safe_dump(data, sort_keys=False)
    try:
        config = load_routing_text(text, "p.yaml")
    except RoutingConfigError as exc:
        assert exc.problems and all(p.line >= 1 and p.column >= 1 for p in exc.problems)
        assert all(str(p).startswith("p.yaml:") for p in exc.problems)
        return
    assert isinstance(config, RoutingConfig)
    for route in config.routes:
        assert all(name in config.providers for name in route.chain)
    for cfg in config.providers.values():
        assert cfg.max_in_flight is None or cfg.max_in_flight >= 1


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=200))
def test_random_text_never_crashes_the_routing_loader(text):
    with contextlib.suppress(RoutingConfigError):
        load_routing_text(text, "t.yaml")


# ---------------------------------------------------------------- the admission gate

operations = st.lists(
    st.tuples(st.sampled_from(["arrive", "finish", "cancel"]), st.integers(0, 20)), min_size=1, max_size=60
)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 3), st.integers(0, 3), operations)
def test_admission_gate_keeps_its_bounds_and_loses_no_slot(max_in_flight, max_queue, ops):
    """Any interleaving of arrivals, finishes and cancellations (of waiting or running requests):
    never more than the limits in flight or queued; a refusal only when both are full; slots handed
    on in arrival order; and once everyone has finished, nothing is held."""

    async def scenario() -> None:
        gate = AdmissionGate("p", max_in_flight, max_queue)
        running: list[int] = []
        waiting: dict[int, asyncio.Task] = {}
        started: list[int] = []
        next_id = 0

        async def request(rid: int) -> None:
            await gate.acquire()
            started.append(rid)
            running.append(rid)

        for op, n in ops:
            if op == "arrive":
                full = gate.full()
                rid, next_id = next_id, next_id + 1
                task = asyncio.ensure_future(request(rid))
                await asyncio.sleep(0)
                if task.done() and isinstance(task.exception(), AdmissionRefused):
                    assert full
                    err = task.exception()
                    assert err.retry_after >= 1 and err.status_code == 429
                elif not task.done():
                    assert not full
                    waiting[rid] = task
                else:
                    assert not full
            elif op == "finish" and running:
                running.pop(n % len(running))
                gate.release(0.01)
            elif op == "cancel" and waiting:
                rid = sorted(waiting)[n % len(waiting)]
                waiting.pop(rid).cancel()
            await asyncio.sleep(0)
            for rid in [r for r, t in waiting.items() if t.done()]:
                del waiting[rid]
            assert gate.in_flight <= max_in_flight and gate.queued <= max_queue
            assert gate.in_flight == len(running)
        # Queued requests start in the order they came.
        assert started == sorted(started)
        for task in waiting.values():
            task.cancel()
        await asyncio.sleep(0)
        while running:
            running.pop()
            gate.release()
            await asyncio.sleep(0)
        assert gate.in_flight == 0 and gate.queued == 0

    asyncio.run(scenario())


def test_gate_retry_after_grows_with_the_queue_ahead():
    gate = AdmissionGate("p", 1, 4)
    gate.in_flight = 1
    gate.release(2.0)  # one slot held 2 s; nobody waiting, so the slot is simply freed
    assert gate.in_flight == 0
    short = gate.retry_after_s()
    gate._waiters.extend([None] * 4)  # type: ignore[list-item]  # four ahead
    assert gate.retry_after_s() > short


@pytest.mark.parametrize(
    "body", [json.dumps({"messages": [{"role": "user", "content": "x"}], "max_tokens": 5})]
)
def test_a_valid_body_passes_every_check(body):
    request = ServerChatRequest.model_validate_json(body)
    check_request(request, max_tokens_limit=10)
