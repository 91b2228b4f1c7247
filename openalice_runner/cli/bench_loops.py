"""`openalice-runner bench-loops`: whole agent conversations against servers side by side."""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path

from openalice_runner.bench.repeats import REPEAT_HELP
from openalice_runner.cli.common import positive_int


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def prefix_cache_reset(urls: str):
    """A callable that empties the prefix cache of each vLLM server (base URL, without /v1)."""
    import httpx

    from openalice_runner.bench.loops import LoopError

    bases = [u.strip().rstrip("/").removesuffix("/v1") for u in urls.split(",") if u.strip()]

    def reset() -> None:
        for base in bases:
            try:
                response = httpx.post(f"{base}/reset_prefix_cache", timeout=30)
            except httpx.HTTPError as exc:
                raise LoopError(f"--reset-prefix-cache: {base}: {exc}") from exc
            if response.status_code != 200:
                raise LoopError(f"--reset-prefix-cache: {base}/reset_prefix_cache answered HTTP "
                                f"{response.status_code}: {response.text[:200]} (VLLM_SERVER_DEV_MODE=1 not set?)")

    return reset


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench-loops",
        help="drive agent-loop conversations through OpenAI-compatible servers (ours, llama.cpp, any URL)",
    )
    p.add_argument("--workload", required=True, help="agent-loops JSON-lines workload (see shared/workloads/README.md)")
    p.add_argument(
        "--targets", default="policy,off",
        help="comma-separated: policy, off (our sidecar with the default policy / speculation off, started "
        "here; policy-inferred, off-inferred: the same, called as Claude Code calls: Messages wire, no turn types stated), llama-cpp, llama-cpp-lookup (from scripts/peer-llama-cpp.sh), vllm, vllm-ngram (vLLM's CPU "
        "build from scripts/peer-vllm-cpu.sh, prefix caching on, n-gram speculation or none); a peer whose "
        "venv is absent is skipped, saying why; URL=NAME: a server already running",
    )  # fmt: skip
    p.add_argument("--conversations", default=None, help="comma-separated conversation ids (default: all)")
    p.add_argument("--repeat", type=positive_int, default=1, help=REPEAT_HELP + "; per (conversation, target)")
    p.add_argument("--warmup", type=non_negative_int, default=1,
                   help="untimed calls per target before the timed runs, shaped like the conversations' first "
                   "calls (tools, tool choice, budget); 0: none (default 1)")
    p.add_argument("--policy", default=None, help="policy file of the target 'policy' (default: the sidecar's default)")
    p.add_argument("--providers", default=None, help="providers YAML for both sidecars (default: the embedded engine)")
    p.add_argument("--threads", type=positive_int, default=2, help="threads of the llama.cpp and vLLM peers")
    p.add_argument("--model", default=None, help="model of the llama.cpp (GGUF) and vLLM (its converted folder) peers "
                   "(default: the engine's default model)")
    p.add_argument("--reset-prefix-cache", default=None, metavar="URL[,URL...]",
                   help="vLLM servers that several targets share (a runner in front of a pool beside the pool "
                   "addressed directly): POST URL/reset_prefix_cache before every timed conversation, so no "
                   "target reuses another's prompts (the servers need VLLM_SERVER_DEV_MODE=1)")
    p.add_argument("--long-prompt", action="store_true",
                   help="each repeat, one call of about 1,200 prompt tokens through every target first: the "
                   "rate the later calls' new prompt tokens are held against, in the same run")
    p.add_argument("--json", dest="json_out", default=None, help="write the report here")
    p.add_argument("--plot", default=None, help="write a PNG of per-call latency here")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from openalice_runner.bench.loop_targets import Servers, TargetUnavailable, parse_targets
    from openalice_runner.bench.loops import LoopError, bench_loops, format_table, load_loops, plot

    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    try:
        specs = parse_targets(args.targets)
        conversations = load_loops(args.workload, args.conversations.split(",") if args.conversations else None)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not conversations:
        print("error: --workload: no conversations", file=sys.stderr)
        return 2
    skipped = {}
    # a terminated benchmark still stops the servers it started (the `with` block's exit)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with Servers(args.policy, args.providers, args.threads, args.model, log=say) as servers:
        targets = []
        for spec in specs:
            try:
                targets.append(servers.start(spec))
            except TargetUnavailable as exc:
                skipped[spec.name] = str(exc)
                say(f"skipping {spec.name}: {exc}")
            except RuntimeError as exc:
                print(f"error: {exc}", file=sys.stderr)
                return 1
        if not targets:
            print("error: no target could run", file=sys.stderr)
            return 1
        try:
            before_run = prefix_cache_reset(args.reset_prefix_cache) if args.reset_prefix_cache else None
            report = bench_loops(conversations, targets, args.repeat, progress=say, warmup=args.warmup,
                                 before_run=before_run, long_prompt=args.long_prompt)
        except LoopError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
    report["settings"] = {
        "workload": args.workload,
        "targets": [t.name for t in targets],
        "skipped": skipped,
        "repeat": args.repeat,
        "kept": report["kept"],
        "warmup": args.warmup,
        "conversations": [c.id for c in conversations],
        "kinds": {c.id: c.kind for c in conversations},
        "policy": args.policy,
        "providers": args.providers,
        "peer_threads": args.threads,
        "reset_prefix_cache": args.reset_prefix_cache,
    }
    print(format_table(report))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=2))
    if args.plot:
        plot(report, args.plot)
    return 0
