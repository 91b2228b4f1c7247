"""The runner on the tiny random model behind a LiveServer, with in-memory spans and metrics, and
the OpenAI error shape a refusal must have."""

from __future__ import annotations

import httpx
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from stand_ins.engines import tiny_engine

from openalice_runner.providers.config import load_routing_text
from openalice_runner.runner import Runner
from openalice_runner.server.app import ServerSettings, create_app
from openalice_runner.server.metrics import ServerMetrics
from openalice_runner.tracing import RunnerTelemetry
from support.live_server import LiveServer

HI = [{"role": "user", "content": "hi"}]
KEY = "hardening-key-1"
AUTH = {"Authorization": f"Bearer {KEY}"}
# `alias-x` is a name a route lists; `agentic` a turn type a route names; other names are unknown.
PROVIDERS = """
providers:
  local: {type: local, tiny_random: true, max_tokens_default: 4}
routes:
  - {name: agentic, match: {turn_types: [agentic]}, chain: [local]}
  - {name: alias, match: {models: [alias-x]}, chain: [local]}
  - {name: default, chain: [local]}
"""
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}

class Stack:
    def __init__(self, *, metrics_public: bool = False) -> None:
        self.spans = InMemorySpanExporter()
        tracer_provider = TracerProvider()
        tracer_provider.add_span_processor(SimpleSpanProcessor(self.spans))
        reader = InMemoryMetricReader()
        telemetry = RunnerTelemetry(tracer_provider, MeterProvider(metric_readers=[reader]))
        self.runner = Runner.from_config(
            providers=load_routing_text(PROVIDERS), policy=False, telemetry=telemetry, engine=tiny_engine()
        )
        self.metrics = ServerMetrics(otel_reader=reader)
        settings = ServerSettings(api_key=KEY, metrics_public=metrics_public, metrics_max_age_s=0.0)
        app = create_app(self.runner, telemetry=telemetry, settings=settings, metrics=self.metrics)
        self.server = LiveServer(app).start()
        self.url = self.server.url

    def post(self, body, headers=None) -> httpx.Response:
        h = {**AUTH, **(headers or {})}
        if isinstance(body, bytes):
            h["Content-Type"] = "application/json"
            return httpx.post(f"{self.url}/v1/chat/completions", content=body, headers=h, timeout=60)
        return httpx.post(f"{self.url}/v1/chat/completions", json=body, headers=h, timeout=60)

    def scrape(self) -> str:
        r = httpx.get(f"{self.url}/metrics", headers=AUTH, timeout=30)
        assert r.status_code == 200, r.text
        return r.text

def openai_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]
