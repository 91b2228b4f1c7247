"""`openalice-runner policy check|explain|speedup|sglang-args`: inspect and use speculation policies.

JSON output is a contract: explain -> {"method", "gamma", "rule", "reason", "policy_version"} (plus "pool",
"options"); speedup -> {"tokens_per_round", "speedup"} (plus "gamma", "best_gamma" with --gamma auto).
Exit codes: 0 ok, 2 invalid policy or arguments.
"""

from __future__ import annotations

import argparse
import json
import sys

from openalice_runner import defaults

# The policy shipped in the package (a copy of policies/default.yaml), found from any directory.
DEFAULT_POLICY = str(defaults.path(defaults.POLICY))


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("policy", help="check, explain and compile speculation policies")
    sub = p.add_subparsers(dest="policy_command", required=True, metavar="SUBCOMMAND")

    check = sub.add_parser("check", help="validate a policy file (exit 2 and FILE:LINE:COL per problem)")
    check.add_argument("file")
    check.add_argument(
        "--providers",
        metavar="FILE",
        default=None,
        help="also check the policy's rules against the SGLang and vLLM pools this routing file deploys "
        "(pool names, methods, tool-call parsers, batch ranges, launch flags, EAGLE heads' targets)",
    )
    check.set_defaults(func=_check)

    explain = sub.add_parser("explain", help="show the decision for one request context")
    explain.add_argument("--policy", default=DEFAULT_POLICY)
    explain.add_argument("--turn-type", required=True)
    explain.add_argument("--batch-size", type=_positive_int, required=True)
    explain.add_argument("--provider", default=None)
    explain.add_argument("--model", default=None)
    explain.add_argument("--json", action="store_true")
    explain.set_defaults(func=_explain)

    speedup = sub.add_parser("speedup", help="expected tokens per round and speedup of speculation")
    speedup.add_argument(
        "--alpha", type=_unit_float, required=True, help="per-token acceptance rate in [0, 1]"
    )
    speedup.add_argument(
        "--gamma", type=_gamma, required=True, help="draft length, or auto (with --max-gamma)"
    )
    speedup.add_argument(
        "--draft-cost", type=_nonneg_float, required=True, help="draft step cost / target pass"
    )
    speedup.add_argument("--min-gamma", type=_positive_int, default=1)
    speedup.add_argument("--max-gamma", type=_positive_int, default=None)
    speedup.add_argument("--json", action="store_true")
    speedup.set_defaults(func=_speedup)

    from openalice_runner.providers.pools.sglang.cli import add_args_parser

    add_args_parser(sub, "sglang-args")  # the same generator as `sglang args`


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _float_in(text: str, lo: float, hi: float) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (lo <= value <= hi):
        raise argparse.ArgumentTypeError(f"expected a number in [{lo}, {hi}], got {text!r}")
    return value


def _unit_float(text: str) -> float:
    return _float_in(text, 0.0, 1.0)


def _nonneg_float(text: str) -> float:
    return _float_in(text, 0.0, 1e6)


def _gamma(text: str) -> int | str:
    return "auto" if text == "auto" else _positive_int(text)


def _load(path: str):
    from openalice_runner.policies import PolicyError, PolicyStore

    try:
        return PolicyStore.from_file(path)
    except PolicyError as exc:
        for problem in exc.problems:
            print(problem, file=sys.stderr)
        return None


def _check(args: argparse.Namespace) -> int:
    from openalice_runner.config_files import ConfigError
    from openalice_runner.policies import load_policy_file

    notes: list = []
    try:
        load_policy_file(args.file)
        problems = []
        if args.providers:
            from openalice_runner.pool_checks import check_pool_files

            problems = check_pool_files(args.file, args.providers, notes)
    except ConfigError as exc:  # the policy (PolicyError) or the routing file on its own
        problems = exc.problems
    for note in notes:  # what was checked less than fully: said, not refused
        print(note, file=sys.stderr)
    if problems:
        for problem in problems:
            print(problem)
        return 2
    print("ok")
    return 0


def _explain(args: argparse.Namespace) -> int:
    from openalice_runner.policies import RequestContext

    store = _load(args.policy)
    if store is None:
        return 2
    d = store.decide(RequestContext(args.turn_type, args.batch_size, args.provider, args.model))
    if args.json:
        print(json.dumps(d.to_dict()))
    else:
        print(f"method {d.method}, gamma {d.gamma}" + (f", pool {d.pool}" if d.pool else ""))
        print(f"rule:    {d.rule}")
        print(f"reason:  {d.reason}")
        print(f"policy:  {args.policy} version {d.policy_version}")
    return 0


def _speedup(args: argparse.Namespace) -> int:
    from openalice_runner.policies.speedup import best_gamma, expected_speedup, tokens_per_round

    out: dict = {}
    if args.gamma == "auto":
        if args.max_gamma is None:
            print("error: --gamma auto needs --max-gamma N", file=sys.stderr)
            return 2
        if args.min_gamma > args.max_gamma:
            print("error: --min-gamma is above --max-gamma", file=sys.stderr)
            return 2
        gamma, _ = best_gamma(args.alpha, args.draft_cost, args.min_gamma, args.max_gamma)
        out["best_gamma"] = gamma
    else:
        gamma = args.gamma
    out = {
        "tokens_per_round": round(tokens_per_round(args.alpha, gamma), 4),
        "speedup": round(expected_speedup(args.alpha, gamma, args.draft_cost), 4),
        "gamma": gamma,
        **out,
    }
    if args.json:
        print(json.dumps(out))
    else:
        best = " (best in range)" if "best_gamma" in out else ""
        print(f"gamma {gamma}{best}: {out['tokens_per_round']:.2f} tokens per round, {out['speedup']:.2f}x")
    return 0
