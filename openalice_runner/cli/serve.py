"""`openalice-runner serve`: the OpenAI-compatible sidecar (FastAPI + uvicorn), on loopback by default."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Callable

from openalice_runner.server.disclosure import LEVELS
from openalice_runner.server.release.modes import parse_release

ENV_API_KEY = "OPENALICE_API_KEY"


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("serve", help="run the OpenAI-compatible HTTP sidecar")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--providers", metavar="FILE",
        help="providers/routes YAML (default: embedded engine); watched: a valid edit applies live, a "
        "broken one keeps the last good config (see /health)",
    )  # fmt: skip
    p.add_argument(
        "--policy", metavar="FILE",
        help="speculation policy YAML, watched and hot-reloaded (default: the shipped copy of policies/default.yaml)",
    )  # fmt: skip
    p.add_argument(
        "--api-key",
        metavar="KEY",
        help=f"require 'Authorization: Bearer KEY' or 'x-api-key: KEY' on /v1/* (default: ${ENV_API_KEY}; none: open)",
    )
    p.add_argument(
        "--keys", metavar="FILE",
        help="keys file (YAML): one tenant per key, stored hashed, each with its own stream release, "
        "speculation info and rate limit; watched and applied live (a broken edit keeps the last good "
        "one). Not with --api-key / $OPENALICE_API_KEY: put that key in the file (docs/security.md)",
    )  # fmt: skip
    p.add_argument("--trace-file", metavar="F", help="write spans as JSON lines to F (see `trace report`)")
    p.add_argument(
        "--trace-file-max-bytes", type=int, default=128 * 1024 * 1024, metavar="N",
        help="past N bytes the trace file moves to F.1 (one kept, owner-only) and a new one starts (128 MiB)",
    )  # fmt: skip
    p.add_argument(
        "--trace-exporter",
        choices=("none", "console", "file", "otlp"),
        help="span exporter (default: OTEL_TRACES_EXPORTER, else file with --trace-file, else none; otlp reads "
        "OTEL_EXPORTER_OTLP_*; metrics are pushed as OTEL_METRICS_EXPORTER says, by default with otlp)",
    )
    p.add_argument(
        "--record-content", action="store_true", help="record message content in spans (off: privacy)"
    )
    p.add_argument(
        "--log-prompts", metavar="FILE",
        help="keep every request's prompt in FILE (JSON lines, owner-only) to train an EAGLE head on "
        "this traffic with `draft train --data FILE` (off: privacy)",
    )  # fmt: skip
    p.add_argument(
        "--max-body-bytes", type=int, default=8 * 1024 * 1024, help="largest request body accepted"
    )
    p.add_argument(
        "--max-in-flight", type=int, metavar="N",
        help="requests each provider serves at once (default: 8 for the embedded engine, 64 for remote "
        "ones; a provider's `max_in_flight` in the providers YAML wins)",
    )  # fmt: skip
    p.add_argument(
        "--max-queue", type=int, metavar="N",
        help="requests allowed to wait per provider; past it 429 with Retry-After at once "
        "(default 16; a provider's `max_queue` in the providers YAML wins)",
    )  # fmt: skip
    p.add_argument(
        "--request-timeout", type=float, default=300.0, metavar="S",
        help="longest a request may take, queueing included (clients may ask for less with the body "
        "field `timeout` or the X-OpenAlice-Timeout header); past it: 408 deadline_exceeded",
    )  # fmt: skip
    p.add_argument(
        "--max-tokens-limit", type=int, default=32_768, metavar="N", help="largest max_tokens accepted"
    )
    p.add_argument(
        "--shutdown-grace", type=float, default=30.0, metavar="S",
        help="on SIGTERM, how long requests in flight may take to finish",
    )  # fmt: skip
    p.add_argument(
        "--header-timeout", type=float, default=10.0, metavar="S",
        help="a connection whose request head has not arrived S seconds after it opened (or after "
        "its previous response) is closed (slow clients hold no connection)",
    )  # fmt: skip
    p.add_argument(
        "--max-connections", type=int, default=512, metavar="N",
        help="open connections allowed for requests; past it (and the reserved slice) a new one gets 503 at "
        "once and is closed",
    )  # fmt: skip
    p.add_argument(
        "--reserved-connections", type=int, default=16, metavar="N",
        help="connections past --max-connections let in for /health and /metrics only (others get 503)",
    )  # fmt: skip
    p.add_argument(
        "--body-timeout", type=float, default=30.0, metavar="S",
        help="a request body must arrive within S seconds of its head; a slower one gets 408 and is closed",
    )  # fmt: skip
    p.add_argument(
        "--min-body-rate", type=float, default=1024.0, metavar="B",
        help="bytes a second a request body must average after its first --body-grace seconds (0: no minimum)",
    )  # fmt: skip
    p.add_argument("--body-grace", type=float, default=5.0, metavar="S", help="see --min-body-rate")
    p.add_argument(
        "--grammar-timeout", type=float, default=10.0, metavar="S",
        help="longest a request's JSON schema or tool grammar may take to compile; past it: 400 grammar_timeout",
    )  # fmt: skip
    p.add_argument(
        "--speculation-info", choices=LEVELS, default="full",
        help="what a reply's `speculation` block shows: full (the default), summary (method, gamma, pool and "
        "rule; no per-request counts, which tell about the text) or none; spans and metrics keep all",
    )  # fmt: skip
    p.add_argument(
        "--stream-release", type=_release, default="pass", metavar="MODE",
        help="how a stream's tokens leave: pass (one event per engine pass, the default: lowest latency), "
        "fixed:N (N tokens an event, padded to a size bucket) or paced (one token an event), the two on "
        "a clock from the tenant's recent decode rate; with +pad (fixed:N+pad, paced+pad) a reply's "
        "writes go on to max_tokens' worth; see docs/security.md",
    )  # fmt: skip
    p.add_argument(
        "--metrics-public", action="store_true",
        help="serve /metrics without the API key (default: /metrics needs it when a key is set)",
    )  # fmt: skip
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    p.set_defaults(func=run)


def _release(text: str) -> object:
    try:
        return parse_release(text)
    except ValueError as exc:  # argparse names the flag: "argument --stream-release: expected ..."
        raise argparse.ArgumentTypeError(str(exc)) from None


def run(args: argparse.Namespace) -> int:
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from openalice_runner.private_file import PrivateFileError
    from openalice_runner.schema_limits import COMPILE
    from openalice_runner.server.app import ServerSettings, create_app
    from openalice_runner.server.connections import DrainingServer
    from openalice_runner.server.metrics import ServerMetrics
    from openalice_runner.tracing.setup import configure_logging, configure_telemetry, exporters_from_env
    from openalice_runner.tracing.telemetry import RunnerTelemetry

    configure_logging(json_logs=True, level=args.log_level)
    try:
        exporter, metrics_exporter = exporters_from_env(args.trace_exporter, args.trace_file)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if exporter == "file" and not args.trace_file:
        print("error: --trace-exporter file needs --trace-file", file=sys.stderr)
        return 2
    problem = _check_limits(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    COMPILE.timeout_s = args.grammar_timeout  # this process's grammar compiles (engine/grammar.py)
    api_key = args.api_key or os.environ.get(ENV_API_KEY) or None
    if args.keys and api_key:
        source = "--api-key" if args.api_key else f"${ENV_API_KEY}"
        print(f"error: --keys and {source} together: one key source only; give that key a tenant in the keys "
              "file (`openalice-runner keys hash` prints its hash)", file=sys.stderr)
        return 2
    if args.keys:
        from openalice_runner.server.tenants.keys_file import KeysFileError, load_keys_file

        try:
            load_keys_file(args.keys)  # refused here, at FILE:LINE:COL, before the model loads
        except KeysFileError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    reader = InMemoryMetricReader()  # /metrics renders the GenAI histograms from it
    try:
        providers = configure_telemetry(
            exporter, args.trace_file, metric_readers=[reader], metrics_exporter=metrics_exporter,
            trace_file_max_bytes=args.trace_file_max_bytes,
        )
    except PrivateFileError as exc:  # a trace file that is a symlink or someone else's
        print(f"error: {exc}", file=sys.stderr)
        return 2
    telemetry = RunnerTelemetry(
        providers.tracer_provider, providers.meter_provider, record_content=args.record_content
    )
    try:
        runner = _build_runner(args, telemetry)
    except Exception as exc:  # a bad config file names itself; no traceback for the operator
        print(f"error: {exc}", file=sys.stderr)
        providers.shutdown()
        return 2
    metrics = ServerMetrics(otel_reader=reader, dropped_spans=lambda: dict(providers.drops.counts))
    app = create_app(
        runner,
        telemetry=telemetry,
        tracer_provider=providers.tracer_provider,
        meter_provider=providers.meter_provider,
        settings=ServerSettings(
            api_key=api_key,
            max_body_bytes=args.max_body_bytes,
            request_timeout_s=args.request_timeout,
            max_tokens_limit=args.max_tokens_limit,
            providers_file=args.providers,
            keys_file=args.keys,
            metrics_public=args.metrics_public,
            speculation_info=args.speculation_info,
            stream_release=args.stream_release,
        ),
        metrics=metrics,
        on_shutdown=providers.force_flush,
    )
    config = uvicorn_config(app, args)
    # uvicorn re-raises the SIGTERM it handled once it has shut down; a handler of our own takes it,
    # so the process goes on to flush its spans and exits 0 instead of dying by the signal.
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        DrainingServer(config).run()  # after SIGTERM: 503 + Retry-After while in-flight requests finish
    finally:
        signal.signal(signal.SIGTERM, previous)
        providers.shutdown()  # flush the spans still queued
    _exit_without_teardown()
    return 0


def uvicorn_config(app, args: argparse.Namespace):
    import uvicorn

    from openalice_runner.server.connections import guarded_h11

    return uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_config=None,  # structlog owns the log format (configure_logging)
        access_log=False,  # GuardMiddleware logs each request with its trace id
        timeout_graceful_shutdown=max(1, round(args.shutdown_grace)),
        # h11 with a request-head deadline and a connection cap (server/connections.py)
        http=guarded_h11(
            args.header_timeout, args.max_connections, reserved_connections=args.reserved_connections,
            body_timeout_s=args.body_timeout, body_grace_s=args.body_grace, min_body_rate=args.min_body_rate,
        ),
        timeout_keep_alive=5,  # idle keep-alive connections close after this (uvicorn's default)
    )


def _exit_without_teardown() -> None:
    """As the process's own program, end now that everything is flushed: tearing down an interpreter
    that holds a model (collecting its objects, unloading torch) took 10-20 s on a busy machine after
    SIGTERM, with nothing left to do. Called in-process (tests, embedding), it returns."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if getattr(spec, "name", None) != "openalice_runner.__main__" and os.path.basename(sys.argv[0]) != "openalice-runner":
        return
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# Each server flag's bound, checked in this order: (is out of bound, the message saying the bound).
_LIMITS: tuple[tuple[Callable[[argparse.Namespace], bool], str], ...] = (
    (lambda a: a.max_body_bytes < 1024, "--max-body-bytes must be at least 1024"),
    (lambda a: a.trace_file_max_bytes < 4096, "--trace-file-max-bytes must be at least 4096"),
    (lambda a: a.max_in_flight is not None and a.max_in_flight < 1, "--max-in-flight must be at least 1"),
    (lambda a: a.max_queue is not None and a.max_queue < 0, "--max-queue must be at least 0"),
    (lambda a: not 0 < a.request_timeout <= 86_400, "--request-timeout must be between 0 and 86400 seconds"),
    (lambda a: a.max_tokens_limit < 1, "--max-tokens-limit must be at least 1"),
    (lambda a: a.shutdown_grace < 0, "--shutdown-grace must be at least 0"),
    (lambda a: not 0 < a.header_timeout <= 3600, "--header-timeout must be between 0 and 3600 seconds"),
    (lambda a: a.max_connections < 1, "--max-connections must be at least 1"),
    (lambda a: a.reserved_connections < 0, "--reserved-connections must be at least 0"),
    (lambda a: not 0 < a.body_timeout <= 3600, "--body-timeout must be between 0 and 3600 seconds"),
    (lambda a: a.min_body_rate < 0 or a.body_grace < 0, "--min-body-rate and --body-grace must be at least 0"),
    (lambda a: not 0 < a.grammar_timeout <= 3600, "--grammar-timeout must be between 0 and 3600 seconds"),
)


def _check_limits(args: argparse.Namespace) -> str | None:
    """The message of the first flag out of its bound; None when all hold."""
    return next((message for out_of_bound, message in _LIMITS if out_of_bound(args)), None)


def _build_runner(args: argparse.Namespace, telemetry):
    from openalice_runner.providers.wrappers.admission import AdmissionLimits
    from openalice_runner.runner import Runner

    admission = AdmissionLimits(max_in_flight=args.max_in_flight, max_queue=args.max_queue)
    return Runner.from_config(
        providers=args.providers, policy=args.policy, telemetry=telemetry, admission=admission,
        prompt_log=args.log_prompts,
    )
