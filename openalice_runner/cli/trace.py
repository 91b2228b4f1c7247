"""`openalice-runner trace report FILE [--plot OUT.png] [--turn ID] [--json]`: read a JSON-lines trace file."""

from __future__ import annotations

import argparse
import json
import sys


def register(subparsers: argparse._SubParsersAction) -> None:
    trace = subparsers.add_parser("trace", help="inspect trace files written with --trace-file")
    trace_sub = trace.add_subparsers(dest="trace_command", required=True, metavar="SUBCOMMAND")
    report = trace_sub.add_parser(
        "report",
        help="per turn type and step: count, p50/p95 latency, ttft, tokens/s, acceptance, gamma",
    )
    report.add_argument("file", help="JSON-lines trace file (serve --trace-file, or exporter 'file')")
    report.add_argument("--plot", metavar="OUT.png", help="draw one turn's waterfall (model and tool calls)")
    report.add_argument(
        "--turn", metavar="ID", help="turn to plot: its span id or trace id (default: most steps)"
    )
    report.add_argument("--json", action="store_true", help="print the report as JSON")
    report.set_defaults(func=run_report)


def run_report(args: argparse.Namespace) -> int:
    from openalice_runner.tracing.jsonl import read_spans
    from openalice_runner.tracing.report import build_report, format_report

    try:
        spans = list(read_spans(args.file))
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    report = build_report(spans)
    if args.plot:
        from openalice_runner.tracing.waterfall import plot_turn

        try:
            report["plot"] = plot_turn(spans, args.plot, args.turn)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(format_report(report))
        if args.plot:
            p = report["plot"]
            print(
                f"\nwaterfall of turn {p['turn']} (trace {p['trace_id']}, {p['steps']} steps) -> {p['plot']}"
            )
    return 0
