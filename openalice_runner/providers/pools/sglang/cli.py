"""`openalice-runner sglang args`: one SGLang pool's launch flags, from the routing file that deploys it.

The routing file owns each pool's launch settings; the policy adds what only its rules know (the
adaptive pool's per-batch step candidates). `policy sglang-args` is the same command under the
policy group. Exit codes: 0 ok, 2 invalid files or arguments.
"""

from __future__ import annotations

import argparse
import json
import sys

from openalice_runner import defaults

DEFAULT_POLICY = str(defaults.path(defaults.POLICY))


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("sglang", help="SGLang pools: launch flags")
    sub = p.add_subparsers(dest="sglang_command", required=True, metavar="SUBCOMMAND")
    add_args_parser(sub, "args")


def add_args_parser(sub: argparse._SubParsersAction, name: str) -> None:
    """The flag generator's arguments; `policy sglang-args` registers it too."""
    a = sub.add_parser(name, help="SGLang launch flags for one pool, one shell-quoted line")
    a.add_argument("--providers", required=True, metavar="FILE", help="the routing file that deploys the pool")
    a.add_argument(
        "--policy",
        default=DEFAULT_POLICY,
        help="the policy whose rules route to the pool (adaptive step candidates; default: the shipped one)",
    )
    a.add_argument("--pool", required=True)
    a.add_argument("--provider", default=None, help="the SGLang provider, where several have the pool")
    a.add_argument(
        "--adaptive-config-out",
        default=None,
        help="where to write the --speculative-adaptive-config JSON (default: the pool's "
        "launch.adaptive_config_path, else ./sglang-adaptive-POOL.json)",
    )
    a.add_argument(
        "--json", action="store_true", help='print {"pool", "args", "line", "adaptive_config", ...}'
    )
    a.set_defaults(func=sglang_args)


def sglang_args(args: argparse.Namespace) -> int:
    from openalice_runner.cli.pool_files import pool_launch_or_none
    from openalice_runner.pool_checks import pool_launch

    launch = pool_launch_or_none(args.policy, args.providers, "sglang", args.pool, args.provider,
                                 lambda pool, policy: pool_launch(pool, policy, args.adaptive_config_out))
    if launch is None:
        return 2
    if launch.adaptive_config is not None:
        try:
            path = launch.write_adaptive_config()
        except OSError as exc:
            print(f"error: cannot write {launch.adaptive_config_path}: {exc.strerror or exc}", file=sys.stderr)
            return 2
        print(f"wrote {path}", file=sys.stderr)
    if args.json:
        out = {
            "pool": launch.pool,
            "args": launch.args,
            "line": launch.line(),
            "adaptive_config": launch.adaptive_config,
            "adaptive_config_path": launch.adaptive_config_path,
        }
        print(json.dumps(out))
    else:
        print(launch.line())
    return 0
