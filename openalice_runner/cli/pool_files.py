"""The policy and routing files a pool's launch line is made from, checked together (shared by
`sglang args` and `vllm args`)."""

from __future__ import annotations

import sys
from typing import Any


def load_checked(policy_path: str, providers_path: str) -> tuple[Any, Any] | None:
    """(policy, routing), or None after printing each problem as FILE:LINE:COL to stderr."""
    from openalice_runner.config_files import ConfigError
    from openalice_runner.policies import load_policy_file
    from openalice_runner.providers.config import load_routing_file
    from openalice_runner.providers.pools.pool_checks import check_pool_files

    try:
        problems = check_pool_files(policy_path, providers_path)
        policy = load_policy_file(policy_path).policy
        routing = load_routing_file(providers_path)
    except ConfigError as exc:
        problems = exc.problems
    if problems:
        for problem in problems:
            print(problem, file=sys.stderr)
        return None
    return policy, routing
