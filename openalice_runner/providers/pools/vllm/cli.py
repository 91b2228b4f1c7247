"""`openalice-runner vllm args`: one vLLM pool's server command line, from the routing file that deploys it.

The routing file owns each pool's launch settings; the policy adds what only its rules know (γ where
the launch leaves it out, `num_speculative_tokens_per_batch_size` from their batch ranges). Prints
`python -m vllm.entrypoints.openai.api_server ...`. Exit codes: 0 ok, 2 invalid files or arguments.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from typing import TYPE_CHECKING

from openalice_runner import defaults

if TYPE_CHECKING:
    from openalice_runner.pool_checks import DeployedPool

DEFAULT_POLICY = str(defaults.path(defaults.POLICY))


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("vllm", help="vLLM pools: server command lines")
    sub = p.add_subparsers(dest="vllm_command", required=True, metavar="SUBCOMMAND")
    a = sub.add_parser("args", help="the vLLM server command line for one pool, shell-quoted")
    a.add_argument("--providers", required=True, metavar="FILE", help="the routing file that deploys the pool")
    a.add_argument(
        "--policy",
        default=DEFAULT_POLICY,
        help="the policy whose rules route to the pool (γ, the per-batch table; default: the shipped one)",
    )
    a.add_argument("--pool", required=True)
    a.add_argument("--provider", default=None, help="the vLLM provider, where several have the pool")
    a.add_argument("--python", default="python", help="the interpreter of vLLM's venv (default: python)")
    a.add_argument("--json", action="store_true", help='print {"pool", "args", "line", "speculative_config"}')
    a.set_defaults(func=vllm_args)


def vllm_args(args: argparse.Namespace) -> int:
    from openalice_runner.cli.pool_files import pool_launch_or_none
    from openalice_runner.pool_checks import vllm_pool_launch

    launch = pool_launch_or_none(args.policy, args.providers, "vllm", args.pool, args.provider,
                                 lambda pool, policy: vllm_pool_launch(with_model_folder(pool), policy))
    if launch is None:
        return 2
    if args.json:
        out = {
            "pool": launch.pool,
            "args": launch.args,
            "line": launch.line(args.python),
            "speculative_config": launch.speculative_config,
        }
        print(json.dumps(out))
    else:
        print(launch.line(args.python))
    return 0


def with_model_folder(deployed: DeployedPool) -> DeployedPool:
    """`model_path: embedded` made the folder the embedded engine converts its default model to
    (converting it here the first time): the folder's name carries a key of the installed GGUF, so
    no routing file can name it for every machine."""
    from openalice_runner.providers.pools.vllm.launch import EMBEDDED_MODEL, VLLMLaunch

    launch = deployed.pool.launch
    if not isinstance(launch, VLLMLaunch) or launch.model_path != EMBEDDED_MODEL:
        return deployed
    from openalice_runner.cli.common import embedded_model_folder

    folder = str(embedded_model_folder())
    pool = deployed.pool.model_copy(update={"launch": launch.model_copy(update={"model_path": folder})})
    return replace(deployed, pool=pool)
