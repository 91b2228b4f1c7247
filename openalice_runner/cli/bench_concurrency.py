"""`openalice-runner bench-concurrency`: throughput and latency against concurrent requests."""

from __future__ import annotations

import argparse
import sys

from openalice_runner import defaults
from openalice_runner.bench.repeats import REPEAT_HELP
from openalice_runner.bench.workload import COPY_HEAVY, OPEN_ENDED
from openalice_runner.cli.common import (
    add_engine_args,
    load_cases,
    load_engine,
    load_policy,
    positive_int,
    progress,
    write_report,
)

SUBSETS = {"chat": OPEN_ENDED, "copy-heavy": COPY_HEAVY, "all": OPEN_ENDED + COPY_HEAVY}


def _levels(text: str) -> list[int]:
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(
            f"--concurrency: a comma-separated list of integers, got {text!r}"
        ) from exc
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError("--concurrency: integers >= 1")
    return levels


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench-concurrency",
        help="aggregate throughput and latency of the batched engine as concurrency grows",
    )
    p.add_argument("--workload", required=True, help="JSON-lines workload (see shared/workloads/README.md)")
    p.add_argument("--concurrency", type=_levels, default=[1, 2, 4, 8, 16])
    p.add_argument(
        "--methods",
        default="off,ngram:5,policy,serial-off,serial-ngram:5",
        help="comma-separated: off, ngram:G, draft:G, policy, serial-<method> (one at a time, c=1 only)",
    )
    p.add_argument(
        "--subsets", default="chat,copy-heavy", help=f"turn-type groups run separately: {', '.join(SUBSETS)}"
    )
    p.add_argument(
        "--policy", default=str(defaults.path(defaults.POLICY)),
        help="policy file for the method 'policy' (default: the shipped copy of policies/default.yaml)",
    )  # fmt: skip
    p.add_argument(
        "--max-batch", type=positive_int, default=None, help="engine batch slots (default: top concurrency)"
    )
    p.add_argument(
        "--repeat", type=positive_int, default=1, help=REPEAT_HELP
    )
    p.add_argument("--json", dest="json_out", default=None, help="write the report here")
    p.add_argument("--plot", default=None, help="write a PNG plot of throughput and latency here")
    add_engine_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from openalice_runner.bench.concurrency import bench_concurrency, format_table, plot
    from openalice_runner.engine import Engine

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    subsets = [s.strip() for s in args.subsets.split(",") if s.strip()]
    unknown = [s for s in subsets if s not in SUBSETS]
    if unknown:
        print(f"error: --subsets: unknown {unknown}; choose from {', '.join(SUBSETS)}", file=sys.stderr)
        return 2
    store = load_policy(args.policy) if "policy" in methods else None
    cases = load_cases(args)
    max_batch = args.max_batch or max(args.concurrency)
    engine = load_engine(args, max_batch=max(2, max_batch))
    serial = None
    if any(m.startswith("serial-") for m in methods):
        serial = Engine(engine.hf_model, engine.tokenizer, engine.model_name, engine.dtype, max_batch=1)
    reports = {}
    for subset in subsets:
        chosen = [c for c in cases if c.turn_type in SUBSETS[subset]]
        print(f"## {subset} ({len(chosen)} cases)", file=sys.stderr, flush=True)
        try:
            reports[subset] = bench_concurrency(
                engine,
                chosen,
                args.concurrency,
                methods,
                store,
                serial,
                progress=progress,
                repeat=args.repeat,
            )
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        print(f"\n### {subset}\n" + format_table(reports[subset]))
    out = {
        "subsets": reports,
        "settings": {
            "dtype": args.dtype,
            "model": engine.model_name,
            "max_batch": engine.max_batch,
            "policy": args.policy,
            "repeat": args.repeat,
        },
    }
    write_report(args.json_out, out)
    if args.plot:
        plot(reports, args.plot)
    return 0
