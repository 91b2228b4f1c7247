"""`python -m openalice_runner.bench.side_channel fingerprint|cost [...]`: see the package docstring."""

from __future__ import annotations

import argparse
import json
import sys

from openalice_runner.bench.side_channel import cost, cross_tenant, fingerprint


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m openalice_runner.bench.side_channel")
    sub = parser.add_subparsers(dest="part", required=True)
    fp = sub.add_parser("fingerprint", help="which prompt was sent, told from the stream's reads, per release mode")
    fp.add_argument("--repeats", type=int, default=6, help="streams per prompt and cell (default 6)")
    fp.add_argument("--prompts", type=int, default=len(fingerprint.PROMPTS),
                    help=f"how many of the {len(fingerprint.PROMPTS)} built-in prompts (default all)")
    fp.add_argument("--max-tokens", type=int, default=40)
    fp.add_argument("--modes", default=",".join(fingerprint.MODES))
    fp.add_argument("--methods", default=",".join(fingerprint.METHODS),
                    help="speculation methods, off the control (default off,ngram,suffix)")
    fp.add_argument("--temperatures", default=",".join(f"{t:g}" for t in fingerprint.TEMPERATURES))
    fp.add_argument("--equal-prompts", action="store_true",
                    help="pad the prompts to one token count first (the first write's time then says nothing "
                    "of a prompt's length, a channel of its own)")
    c = sub.add_parser("cost", help="the agent loops under each release mode, side by side")
    c.add_argument("--workload", required=True, help="agent-loops JSON-lines workload")
    c.add_argument("--repeat", type=int, default=3, help="odd: the median run is kept (default 3)")
    c.add_argument("--modes", default=",".join(fingerprint.MODES))
    c.add_argument("--conversations", default=None, help="comma-separated conversation ids (default: all)")
    x = sub.add_parser("cross-tenant", help="whether one tenant's reply drafts for another (suffix speculation)")
    x.add_argument("--max-tokens", type=int, default=96)
    for p in (fp, c, x):
        p.add_argument("--providers", default=None, help="providers YAML for the servers (default: the embedded engine)")
        p.add_argument("--json", dest="json_out", default=None, help="write the report here")
    args = parser.parse_args(argv)

    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    def keep(report: dict) -> None:
        if args.json_out:
            with open(args.json_out + ".partial", "w") as f:
                json.dump(report, f)

    modes = tuple(m.strip() for m in getattr(args, "modes", "").split(",") if m.strip())
    if args.part == "fingerprint":
        if not 2 <= args.prompts <= len(fingerprint.PROMPTS) or args.repeats < 2:
            parser.error(f"--prompts must be 2..{len(fingerprint.PROMPTS)} and --repeats at least 2")
        report = fingerprint.run(fingerprint.PROMPTS[:args.prompts], args.repeats, modes,
                                 methods=tuple(m.strip() for m in args.methods.split(",") if m.strip()),
                                 temperatures=tuple(float(t) for t in args.temperatures.split(",")),
                                 max_tokens=args.max_tokens, providers=args.providers,
                                 equal_prompts=args.equal_prompts, log=say, checkpoint=keep)
        table = fingerprint.format_table(report)
    elif args.part == "cross-tenant":
        report = cross_tenant.run(max_tokens=args.max_tokens, providers=args.providers, log=say)
        table = cross_tenant.format_table(report)
    else:
        ids = args.conversations.split(",") if args.conversations else None
        report = cost.run(args.workload, modes, repeat=args.repeat, providers=args.providers,
                          conversations=ids, log=say)
        table = cost.format_table(report)
    print(table)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
