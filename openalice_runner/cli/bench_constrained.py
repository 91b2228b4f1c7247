"""`openalice-runner bench-constrained`: grammar-constrained turns, with and without forced drafts."""

from __future__ import annotations

import argparse

from openalice_runner.cli.common import (
    add_engine_args,
    load_cases,
    load_engine,
    positive_int,
    progress,
    write_report,
)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench-constrained",
                       help="tool-call and structured-output turns: unconstrained, constrained, + forced drafts, + ngram")
    p.add_argument("--workload", required=True, help="JSON-lines workload (see shared/workloads/README.md)")
    p.add_argument("--cases", default=None, help="comma-separated case ids (default: every tool_call, summarize, rag)")
    p.add_argument("--gamma", type=positive_int, default=5, help="n-gram draft length of the last mode")
    p.add_argument("--repeat", type=positive_int, default=1, help="runs per mode, in turns; the row keeps the fastest")
    p.add_argument("--json", dest="json_out", default=None, help="write the report here")
    add_engine_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from openalice_runner.bench.constrained import bench_constrained, format_table

    cases = load_cases(args)
    engine = load_engine(args, max_batch=1)
    engine.time_passes()  # n-gram sizes its drafts from measured pass costs, as when serving
    report = bench_constrained(engine, cases, args.gamma, args.repeat, progress=progress)
    print(format_table(report))
    write_report(args.json_out, report)
    return 0
