"""OpenTelemetry tracing and metrics of turns, model calls and tool steps (GenAI conventions).

Library side: RunnerTelemetry and InstrumentedProvider; they never install a global provider.
Application side (CLI, server): openalice_runner.tracing.setup.configure_telemetry.
"""

from __future__ import annotations

from openalice_runner.tracing.telemetry import ChatCall, RunnerTelemetry, current_trace_ids

__all__ = ["ChatCall", "InstrumentedProvider", "RunnerTelemetry", "current_trace_ids"]


def __getattr__(name: str):
    # Lazy: InstrumentedProvider imports the providers package, which may import the runner's types.
    if name == "InstrumentedProvider":
        from openalice_runner.tracing.instrumented import InstrumentedProvider

        return InstrumentedProvider
    raise AttributeError(name)
