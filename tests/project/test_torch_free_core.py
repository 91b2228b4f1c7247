"""The middleware runs without torch: routing, policy, fallback, tracing and the HTTP server serve a
scripted provider in a process where importing torch or transformers fails. (The packaging test
shows the same for an install without the engine extra; this one runs on every test run in
seconds, and covers the server and the policy too.)"""

from __future__ import annotations

import subprocess
import sys
import textwrap

from locations import TESTS

SCRIPT = textwrap.dedent("""\
    import asyncio, sys

    # As on an install without the engine extra: `import torch` fails, find_spec("torch") is None.
    for name in ("torch", "transformers"):
        sys.modules[name] = None
    sys.path.insert(0, TESTS)

    import httpx
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from stand_ins.scripted import ScriptedProvider, scripted_runner

    from openalice_runner.policies import PolicyStore
    from openalice_runner.server.app import create_app
    from openalice_runner.tracing import RunnerTelemetry

    POLICY = "rules:\\n  - name: copy\\n    match: {turn_type: code_edit}\\n    method: ngram\\n    gamma: 4\\n" \\
             "default: {method: off}\\n"

    async def main():
        exporter = InMemorySpanExporter()
        tracer_provider = TracerProvider()
        tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
        telemetry = RunnerTelemetry(tracer_provider)
        provider = ScriptedProvider()
        runner = scripted_runner(provider, policy=PolicyStore.from_text(POLICY), telemetry=telemetry)
        app = create_app(runner, telemetry=telemetry, tracer_provider=tracer_provider)
        body = {"messages": [{"role": "user", "content": "copy this"}], "max_tokens": 8}
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            plain = (await client.post("/v1/chat/completions", json=body,
                                       headers={"X-OpenAlice-Turn-Type": "code_edit"})).json()
            streamed = await client.post("/v1/chat/completions", json={**body, "stream": True})
        assert plain["choices"][0]["message"]["content"] == "you said: copy this", plain
        assert (plain["speculation"]["method"], plain["speculation"]["gamma"]) == ("ngram", 4), plain
        assert '" this"' in streamed.text and streamed.text.rstrip().endswith("data: [DONE]"), streamed.text
        assert provider.closed_streams == 1
        assert any(s.name.startswith("chat ") for s in exporter.get_finished_spans())
        assert runner.policy.adaptive.snapshot()["alpha"], "the policy learned from the outcome"
        await runner.aclose()
        assert not [m for m, mod in sys.modules.items() if m.split(".")[0] in ("torch", "transformers") and mod]
        assert "openalice_runner.engine" not in sys.modules
        print("torch-free ok")

    asyncio.run(main())
    """)


def test_routing_policy_tracing_and_server_run_without_torch():
    out = subprocess.run(
        [sys.executable, "-c", f"TESTS = {str(TESTS)!r}\n" + SCRIPT],
        capture_output=True, text=True, timeout=120, cwd=TESTS.parent,
    )  # fmt: skip
    assert out.returncode == 0 and "torch-free ok" in out.stdout, out.stdout + out.stderr
