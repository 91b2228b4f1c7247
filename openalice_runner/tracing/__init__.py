"""OpenTelemetry tracing and metrics of turns, model calls and tool steps (GenAI conventions).

Library side: RunnerTelemetry; it never installs a global provider. The provider wrapper that traces
each model call is openalice_runner.providers.wrappers.instrumented.InstrumentedProvider (providers depend on
tracing, never the reverse).
Application side (CLI, server): openalice_runner.tracing.setup.configure_telemetry.
"""

from __future__ import annotations

from openalice_runner.tracing.chat_call import ChatCall
from openalice_runner.tracing.telemetry import RunnerTelemetry, current_trace_ids

__all__ = ["ChatCall", "RunnerTelemetry", "current_trace_ids"]
