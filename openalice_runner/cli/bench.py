"""`openalice-runner bench`: workload cases × methods, side by side, greedy."""

from __future__ import annotations

import argparse
import json
import sys

from openalice_runner.bench.repeats import REPEAT_HELP
from openalice_runner.cli.common import (
    add_engine_args,
    load_cases,
    load_engine,
    load_policy,
    positive_int,
    progress,
    write_report,
)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmark methods on a workload file, side by side")
    p.add_argument("--workload", required=True, help="JSON-lines workload (see shared/workloads/README.md)")
    p.add_argument("--cases", default=None, help="comma-separated case ids (default: all)")
    p.add_argument("--methods", default="off,ngram,draft,hf-plain,hf-prompt-lookup",
                   help="comma-separated: off, ngram, draft, eagle, eagle-lookup, eagle-tree, eagle-lookup-tree, policy, "
                        "hf-plain, hf-prompt-lookup; NAME:G fixes γ")
    p.add_argument("--eagle-head", default=None, help="folder of a trained EAGLE head, for the eagle methods")
    p.add_argument("--gamma", type=positive_int, default=5)
    p.add_argument("--tree-nodes", type=positive_int, default=None,
                   help="most tokens of a draft tree in eagle-tree and eagle-lookup-tree (default 8, 2 to 63)")
    p.add_argument("--repeat", type=positive_int, default=1, help=REPEAT_HELP)
    p.add_argument("--policy", default=None, help="policy file: adds the method 'policy'")
    p.add_argument("--json", dest="json_out", default=None, help="write the report here")
    add_engine_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from openalice_runner.bench.runner import EAGLE_TREE_NODES, bench, format_table

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    tree_nodes = EAGLE_TREE_NODES if args.tree_nodes is None else args.tree_nodes
    if not 2 <= tree_nodes <= 63:
        print(f"error: --tree-nodes: must be in [2, 63], got {tree_nodes}", file=sys.stderr)
        return 2
    store = load_policy(args.policy)
    if store is not None and "policy" not in methods:
        methods.append("policy")
    cases = load_cases(args)
    engine = load_engine(args)
    try:
        report = bench(engine, cases, methods, gamma=args.gamma, repeat=args.repeat, policy_store=store,
                       progress=progress, eagle_head=args.eagle_head, tree_nodes=tree_nodes)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    report["settings"] = {"dtype": args.dtype, "gamma": args.gamma, "repeat": args.repeat,
                          "model": engine.model_name, "policy": args.policy,
                          "eagle_head": args.eagle_head, "tree_nodes": tree_nodes}
    print(format_table(report))
    print(json.dumps(report["summary"], indent=2))
    write_report(args.json_out, report)
    return 0
