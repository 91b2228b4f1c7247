"""The policy and routing files a pool's launch line is made from, checked together (shared by
`sglang args` and `vllm args`)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, TypeVar

Launch = TypeVar("Launch")


def load_checked(policy_path: str, providers_path: str) -> tuple[Any, Any] | None:
    """(policy, routing), or None after printing each problem as FILE:LINE:COL to stderr."""
    from openalice_runner.config_files import ConfigError
    from openalice_runner.policies import load_policy_file
    from openalice_runner.pool_checks import check_pool_files
    from openalice_runner.providers.config import load_routing_file

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


def pool_launch_or_none(policy_path: str, providers_path: str, dialect: str, pool: str, provider: str | None,
                        build: Callable[[Any, Any], Launch]) -> Launch | None:
    """`build(pool, policy)` for the named pool of the checked files, or None after printing what
    is wrong (the files' problems, an unknown pool, a launch the pool's settings cannot make)."""
    from openalice_runner.pool_checks import find_pool

    files = load_checked(policy_path, providers_path)
    if files is None:
        return None
    policy, routing = files
    try:
        return build(find_pool(routing, pool, provider, dialect=dialect), policy)
    except KeyError as exc:
        print(f"error: {exc.args[0]}", file=sys.stderr)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
    return None
