"""`serve --speculation-info full|summary|none`: what a reply's `speculation` block shows its caller,
on all three wires, plain and streamed; the spans keep every figure (they are the operator's).

Per-request counts (proposed, accepted, target passes, ...) depend on the text, so they tell an
observer about it (arXiv 2411.01076): `summary` keeps the decision and drops the counts, `none`
drops the block. The `full` run is the control: the same requests show the counts there."""

from __future__ import annotations

import json

import httpx
import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from stand_ins.engines import tiny_engine
from support.live_server import LiveServer

from openalice_runner.providers.config import load_routing_text
from openalice_runner.runner import Runner
from openalice_runner.server.app import ServerSettings, create_app
from openalice_runner.server.disclosure import COUNTS
from openalice_runner.tracing import RunnerTelemetry
from openalice_runner.tracing import attributes as A

PROVIDERS = """
providers:
  local: {type: local, tiny_random: true, max_tokens_default: 8}
routes:
  - {name: default, chain: [local]}
"""
NGRAM = 'version: 1\nname: ngram\ndefault:\n  method: ngram\n  gamma: 3\n'
PROMPT = "one two three one two three one two three one two"


@pytest.fixture(scope="module")
def engine():
    return tiny_engine()


@pytest.fixture(scope="module", params=["full", "summary", "none"])
def served(request, engine, tmp_path_factory):
    policy = tmp_path_factory.mktemp("policy") / "ngram.yaml"
    policy.write_text(NGRAM)
    spans = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
    telemetry = RunnerTelemetry(tracer_provider, MeterProvider())
    runner = Runner.from_config(
        providers=load_routing_text(PROVIDERS), policy=str(policy), telemetry=telemetry, engine=engine
    )
    app = create_app(runner, telemetry=telemetry, settings=ServerSettings(speculation_info=request.param))
    live = LiveServer(app).start()
    live.level, live.spans, live.model = request.param, spans, runner.model_names()[0]
    yield live
    live.stop()


def _chat(model, stream):
    return "/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": PROMPT}],
                                    "max_tokens": 8, "stream": stream, "stream_options": {"include_usage": True}
                                    } if stream else {"model": model, "max_tokens": 8,
                                                      "messages": [{"role": "user", "content": PROMPT}]}


def _messages(model, stream):
    return "/v1/messages", {"model": model, "max_tokens": 8, "stream": stream,
                            "messages": [{"role": "user", "content": PROMPT}]}


def _responses(model, stream):
    return "/v1/responses", {"model": model, "max_output_tokens": 16, "stream": stream, "input": PROMPT}


def _speculation_blocks(text: str, stream: bool) -> list[dict]:
    """Every `speculation` object anywhere in the reply (a body, or each SSE event's data)."""
    found: list[dict] = []

    def walk(value):
        if isinstance(value, dict):
            for key, inner in value.items():
                if key == "speculation" and isinstance(inner, dict):
                    found.append(inner)
                else:
                    walk(inner)
        elif isinstance(value, list):
            for inner in value:
                walk(inner)

    if stream:
        for line in text.splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":
                walk(json.loads(line[6:]))
    else:
        walk(json.loads(text))
    return found


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
@pytest.mark.parametrize("build", [_chat, _messages, _responses], ids=["chat", "messages", "responses"])
def test_the_reply_shows_what_the_level_allows(served, build, stream):
    path, body = build(served.model, stream)
    served.spans.clear()
    reply = httpx.post(served.url + path, json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    blocks = _speculation_blocks(reply.text, stream)
    if served.level == "none":
        assert blocks == [] and '"speculation"' not in reply.text
    else:
        assert blocks, "the reply carries no speculation block"
        for block in blocks:
            assert block["method"] == "ngram" and block["gamma"] == 3
            shown = {k for k in COUNTS if block.get(k) is not None}
            if served.level == "full":  # the control: the counts are there to hide
                assert {"proposed", "accepted", "target_passes", "tokens_per_pass"} <= shown, block
            else:
                assert shown == set(), block
                assert block.get("accept_length") is None  # the old name of tokens_per_pass
    # the operator's figures stay whole at every level
    recorded = [s.attributes for s in served.spans.get_finished_spans() if A.SPEC_TARGET_PASSES in s.attributes]
    assert recorded and recorded[-1][A.SPEC_TARGET_PASSES] > 0
