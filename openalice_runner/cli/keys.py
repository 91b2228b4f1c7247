"""`openalice-runner keys hash` (the key read from stdin, its hash printed) and `keys check FILE`: what a
keys file (`serve --keys FILE`) holds, and whether it would load."""

from __future__ import annotations

import argparse
import sys

MIN_KEY_CHARS = 16  # a key the keys file's hash can stand for: a short one is guessed from its hash


def register(subparsers: argparse._SubParsersAction) -> None:
    keys = subparsers.add_parser("keys", help="API keys of `serve --keys FILE`: hash a key, check a file")
    keys_sub = keys.add_subparsers(dest="keys_command", required=True, metavar="SUBCOMMAND")
    hashed = keys_sub.add_parser(
        "hash", help="read a key from stdin (one line) and print the sha256 hex the keys file stores for it",
    )  # fmt: skip
    hashed.set_defaults(func=run_hash)
    check = keys_sub.add_parser("check", help="load a keys file as `serve --keys` does; problems at FILE:LINE:COL")
    check.add_argument("file")
    check.set_defaults(func=run_check)


def run_hash(args: argparse.Namespace) -> int:
    from openalice_runner.server.tenants.keys_file import key_hash

    key = sys.stdin.readline().strip()  # as the server reads a key: without surrounding whitespace
    if len(key) < MIN_KEY_CHARS:
        print(f"error: a key needs at least {MIN_KEY_CHARS} characters (its hash is in the keys file, and a "
              "short key is found from it by trying); make one with `openssl rand -hex 32`", file=sys.stderr)
        return 2
    print(key_hash(key))
    return 0


def run_check(args: argparse.Namespace) -> int:
    from openalice_runner.server.tenants.keys_file import KeysFileError, load_keys_file

    try:
        entries = load_keys_file(args.file)
    except KeysFileError as exc:
        print(exc, file=sys.stderr)
        return 2
    for _, tenant in entries:
        release = str(tenant.stream_release) if tenant.stream_release else "(serve's)"
        info = tenant.speculation_info or "(serve's)"
        limit = f"{tenant.requests_per_minute}/min" if tenant.requests_per_minute else "none"
        print(f"{tenant.name}: stream_release {release}, speculation_info {info}, rate limit {limit}")
    return 0
