"""`openalice-runner` command line. Each subcommand lives in its own module with `register()`.

Heavy imports (torch, transformers, fastapi) happen inside the commands, so `--help` is instant.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# module name under openalice_runner.cli (or a full name: a pool dialect's command lives in its wing)
# -> registers one or more subcommands
_COMMAND_MODULES = ("generate", "bench", "bench_concurrency", "bench_follow_up", "bench_loops", "bench_constrained",
                    "policy", "openalice_runner.providers.pools.sglang.cli",
                    "openalice_runner.providers.pools.vllm.cli", "serve", "keys", "trace", "loadtest", "draft")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="openalice-runner",
        description="Model backend for agentic loops: embedded speculative decoding, policy, sidecar.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in _COMMAND_MODULES:
        # a module that fails to import is an error, not a missing command: --help must not hide it
        module = name if name.startswith("openalice_runner.") else f"openalice_runner.cli.{name}"
        importlib.import_module(module).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code = args.func(args)
    except KeyboardInterrupt:
        return 130
    return int(code or 0)


if __name__ == "__main__":
    sys.exit(main())
