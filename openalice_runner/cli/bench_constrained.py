"""`openalice-runner bench-constrained`: grammar-constrained turns, with and without forced drafts."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from openalice_runner.cli.common import add_engine_args, positive_int


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
    from openalice_runner.bench.workload import load_workload
    from openalice_runner.engine import Engine, ModelNotFoundError

    try:
        cases = load_workload(args.workload, args.cases.split(",") if args.cases else None)
    except (OSError, ValueError) as exc:
        print(f"error: --workload: {exc}", file=sys.stderr)
        return 2
    try:
        engine = Engine.load(args.model, dtype=args.dtype, threads=args.threads, max_batch=1)
    except ModelNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    engine.time_passes()  # n-gram sizes its drafts from measured pass costs, as when serving
    report = bench_constrained(engine, cases, args.gamma, args.repeat,
                               progress=lambda line: print(line, file=sys.stderr, flush=True))
    print(format_table(report))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=2))
    return 0
