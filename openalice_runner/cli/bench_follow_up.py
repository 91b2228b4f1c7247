"""`openalice-runner bench-follow-up`: an agent loop's next call, with and without prefix reuse."""

from __future__ import annotations

import argparse

from openalice_runner.bench.repeats import REPEAT_HELP
from openalice_runner.cli.common import (
    add_engine_args,
    load_cases,
    load_engine,
    positive_int,
    progress,
    write_report,
)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench-follow-up",
                       help="time an agent loop's follow-up call with the engine's prefix reuse off and on")
    p.add_argument("--workload", required=True, help="JSON-lines workload (see shared/workloads/README.md)")
    p.add_argument("--cases", default=None, help="comma-separated case ids (default: all)")
    p.add_argument("--max-tokens", type=positive_int, default=64, help="budget of the follow-up call")
    p.add_argument("--repeat", type=positive_int, default=1, help=REPEAT_HELP)
    p.add_argument("--json", dest="json_out", default=None, help="write the report here")
    add_engine_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from openalice_runner.bench.follow_up import bench_follow_up, format_table

    cases = load_cases(args)
    engine = load_engine(args, max_batch=2)
    report = bench_follow_up(engine, cases, args.max_tokens, args.repeat, progress=progress)
    print(format_table(report))
    write_report(args.json_out, report)
    return 0
