"""EAGLE-3 heads on agent-loop conversations, side by side (issue 47): tokens per target pass and wall
time of each target, round-robin, the median of odd repeats.

    python -m openalice_runner.bench.eagle3_heads vllm --head DIR --workload agent-loops.jsonl \\
        --conversations loop-chat-plan [--repeat 3] [--k 3] [--eager] [--json OUT]
    python -m openalice_runner.bench.eagle3_heads embedded --head NAME=DIR [--head NAME=DIR ...] \\
        --workload agent-loops.jsonl --conversations loop-chat-plan [--repeat 3] [--gamma 3] [--json OUT]

`vllm`: vLLM's CPU build three times, as bench-loops starts it (scripts/vllm-cpu-serve.sh, bf16, 2
threads, prefix caching, hermes tools), all up at once so the runs can alternate: `vllm` plain,
`vllm-ngram` (bench-loops' n-gram settings) and `vllm-eagle3` (`--speculative-config
{"method":"eagle3","model":DIR,"num_speculative_tokens":K}`). `--eager`: all three in eager mode
(--enforce-eager); `--threads 1`: one OpenMP thread each, for a machine other work loads. Each run's figures are the deltas of the server's own /metrics counters over the
run (nothing else runs on it then): tokens generated, drafts accepted, and per draft position.
`embedded`: our sidecar with speculation off, and one sidecar per head with a policy that sends every
turn to `method: eagle` with that head (chains of up to `--gamma`, no prompt lookup, no tree); the
figures come from the replies' `speculation` extension; `--threads N` (not 2) gives the sidecars a
providers file whose embedded engine runs N threads.

Tokens per target pass = tokens / (tokens - accepted drafts), over all runs: each target pass, the
prompt's included, yields one token of its own plus the drafts it accepted (1.0 without speculation).
Wall time: per conversation the median run; `speedup` is the first target's time over each one's
(geometric mean over conversations). `same_as_first`: calls whose output equals the first target's
in the same run (bf16 numerics and speculation's batched verify may split greedy replies).
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from openalice_runner.bench.loop_targets import Servers, TargetSpec
from openalice_runner.bench.loops import (
    Target,
    geomean,
    load_loops,
    run_conversation,
    schedule,
    served_model,
    warm_up,
)
from openalice_runner.bench.repeats import kept_label, kept_run

VLLM_COUNTERS = {
    "vllm:generation_tokens_total": "tokens",
    "vllm:spec_decode_num_drafts_total": "drafts",
    "vllm:spec_decode_num_draft_tokens_total": "proposed",
    "vllm:spec_decode_num_accepted_tokens_total": "accepted",
}
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
LOCAL_PROVIDERS = """\
providers:
  local: {{type: local, threads: {threads}}}
routes:
  - {{name: default, match: {{models: ["*"]}}, chain: [local]}}
"""


def vllm_counters(client, url: str) -> dict[str, float]:
    """The spec-decode and generation counters of a vLLM server (base URL with /v1), summed over labels."""
    base = url.removesuffix("/v1")
    text = client.get(f"{base}/metrics", timeout=30).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"^(vllm:[a-z_]+)(\{[^}]*\})? ([0-9.e+-]+)$", line)
        if not m:
            continue
        name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
        if name in VLLM_COUNTERS:
            out[VLLM_COUNTERS[name]] = out.get(VLLM_COUNTERS[name], 0.0) + value
        elif name == PER_POS:
            pos = re.search(r'position="(\d+)"', labels)
            if pos:
                key = f"pos{int(pos.group(1)) + 1}"
                out[key] = out.get(key, 0.0) + value
    return out


@dataclass
class Tally:
    """One target's counts over all its runs."""

    tokens: float = 0.0
    accepted: float = 0.0
    proposed: float = 0.0
    drafts: float = 0.0
    per_pos: dict[str, float] = field(default_factory=dict)

    def add(self, delta: dict[str, float]) -> None:
        self.tokens += delta.get("tokens", 0.0)
        self.accepted += delta.get("accepted", 0.0)
        self.proposed += delta.get("proposed", 0.0)
        self.drafts += delta.get("drafts", 0.0)
        for k, v in delta.items():
            if k.startswith("pos"):
                self.per_pos[k] = self.per_pos.get(k, 0.0) + v

    def as_json(self) -> dict[str, Any]:
        passes = self.tokens - self.accepted
        out: dict[str, Any] = {
            "tokens": int(self.tokens), "accepted": int(self.accepted), "proposed": int(self.proposed),
            "target_passes": int(passes),
            "tokens_per_pass": round(self.tokens / passes, 3) if passes > 0 else None,
            "acceptance": round(self.accepted / self.proposed, 3) if self.proposed else None,
        }
        if self.drafts and self.per_pos:  # accepted at position i over drafts: vLLM's per-position rate
            out["per_position"] = [round(self.per_pos[k] / self.drafts, 3) for k in sorted(self.per_pos)]
        return out


def sidecar_delta(calls) -> dict[str, float]:
    """A sidecar run's counts from its replies' usage and `speculation` extension."""
    out = {"tokens": 0.0, "accepted": 0.0, "proposed": 0.0}
    for c in calls:
        out["tokens"] += c.completion_tokens or 0
        spec = c.speculation or {}
        out["accepted"] += spec.get("accepted") or 0
        out["proposed"] += spec.get("proposed") or 0
    return out


def measure(conversations, targets: list[Target], vllm_names: set[str], repeat: int, warmup: int,
            say) -> dict[str, Any]:
    import httpx

    tallies = {t.name: Tally() for t in targets}
    per_row: dict[tuple[str, str], Tally] = {}  # (conversation, target): the same counts, one conversation's
    runs: dict[tuple[str, str], list[dict]] = {}
    with httpx.Client(timeout=httpx.Timeout(600.0, connect=10.0)) as client:
        for target in targets:
            target.model = target.model or served_model(client, target)
            warm = warm_up(client, target, conversations, warmup)
            say(f"{target.name}: warm-up {[round(r.seconds, 2) for r in warm]} s")
        for run, conversation, target in schedule(conversations, targets, repeat):
            before = vllm_counters(client, target.url) if target.name in vllm_names else None
            done = run_conversation(client, target, conversation, run)
            if before is not None:
                after = vllm_counters(client, target.url)
                delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
            else:
                delta = sidecar_delta(done["calls"])
            tallies[target.name].add(delta)
            per_row.setdefault((conversation.id, target.name), Tally()).add(delta)
            runs.setdefault((conversation.id, target.name), []).append(done)
            say(f"{conversation.id} {target.name} run {run}: {done['seconds']:.2f} s, "
                f"{sum(c.completion_tokens or 0 for c in done['calls'])} tokens")
    first = targets[0].name
    rows = []
    for conversation in conversations:
        for target in targets:
            done = runs[conversation.id, target.name]
            kept = kept_run(done, seconds=lambda r: r["seconds"])
            same = sum(a.output == b.output for mine, base in zip(done, runs[conversation.id, first], strict=True)
                       for a, b in zip(mine["calls"], base["calls"], strict=False))
            rows.append({"id": conversation.id, "target": target.name, "seconds": kept["seconds"],
                         "runs_seconds": [r["seconds"] for r in done],
                         "tokens": sum(c.completion_tokens or 0 for c in kept["calls"]),
                         "same_as_first": f"{same}/{sum(len(r['calls']) for r in done)}",
                         **{k: v for k, v in per_row[conversation.id, target.name].as_json().items()
                            if k in ("tokens_per_pass", "acceptance", "per_position")}})
    by = {(r["id"], r["target"]): r for r in rows}
    summary = {}
    for target in targets:
        ratios = [by[c.id, first]["seconds"] / by[c.id, target.name]["seconds"] for c in conversations]
        summary[target.name] = {"seconds": round(sum(by[c.id, target.name]["seconds"] for c in conversations), 3),
                                "speedup": geomean(ratios), **tallies[target.name].as_json()}
    return {"kept": kept_label(repeat), "conversations": rows, "summary": summary}


def format_report(report: dict[str, Any]) -> str:
    lines = [f"rows: {report['kept']}, round-robin", "",
             "| conversation | target | seconds (runs) | tokens | tokens/pass | acceptance | same as first |",
             "|---|---|---|---|---|---|---|"]
    for r in report["conversations"]:
        lines.append(f"| {r['id']} | {r['target']} | {r['seconds']:.2f} ({', '.join(f'{x:.2f}' for x in r['runs_seconds'])}) "
                     f"| {r['tokens']} | {r['tokens_per_pass']} | {r['acceptance']} | {r['same_as_first']} |")
    lines += ["", "| target | seconds | speedup | tokens/pass | acceptance | per position | tokens | passes |",
              "|---|---|---|---|---|---|---|---|"]
    for name, s in report["summary"].items():
        pos = ", ".join(f"{x:.3f}" for x in s.get("per_position", [])) or "-"
        lines.append(f"| {name} | {s['seconds']:.2f} | {s['speedup']} | {s['tokens_per_pass']} | {s['acceptance']} "
                     f"| {pos} | {s['tokens']} | {s['target_passes']} |")
    return "\n".join(lines)


def head_policy(name: str, head: Path, gamma: int) -> str:
    return (f"version: 1\nname: {json.dumps(name)}\ndescription: every turn to this EAGLE head (bench eagle3_heads)\n"
            f"default:\n  method: eagle\n  gamma: {gamma}\n  options: {{eagle_head: {json.dumps(str(head))}}}\n")


def parse_heads(items: list[str]) -> list[tuple[str, Path]]:
    heads = []
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--head: {item!r} is not NAME=DIR")
        if not (Path(path).expanduser() / "config.json").is_file():
            raise ValueError(f"--head: {path} holds no config.json (a folder `draft train` wrote)")
        heads.append((name, Path(path).expanduser().resolve()))
    if len({n for n, _ in heads}) != len(heads) or any(n == "off" for n, _ in heads):
        raise ValueError("--head: give each NAME once, not 'off'")
    return heads


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m openalice_runner.bench.eagle3_heads")
    sub = parser.add_subparsers(dest="engine", required=True)
    v = sub.add_parser("vllm", help="vLLM-CPU plain, n-gram and EAGLE-3 with a head")
    v.add_argument("--head", required=True, help="the head's folder (draft train --layout eagle3)")
    v.add_argument("--k", type=int, default=3, help="num_speculative_tokens of the EAGLE-3 server (default 3)")
    v.add_argument("--eager", action="store_true", help="all three servers with --enforce-eager")
    e = sub.add_parser("embedded", help="the embedded engine: off and one sidecar per head")
    e.add_argument("--head", action="append", required=True, metavar="NAME=DIR", help="a head folder, either layout")
    e.add_argument("--gamma", type=int, default=3, help="the policy's γ, a cap on each chain (default 3)")
    for p in (v, e):
        p.add_argument("--threads", type=int, default=2,
                       help="threads of each server (default 2; 1 on a machine other work loads: a 2-thread pool "
                       "waits at every barrier for a thread the OS has given to another process)")
        p.add_argument("--workload", required=True, help="agent-loops JSON-lines workload")
        p.add_argument("--conversations", default=None, help="comma-separated conversation ids (default: all)")
        p.add_argument("--repeat", type=int, default=3, help="runs per (conversation, target); odd: the median")
        p.add_argument("--warmup", type=int, default=1, help="untimed calls per target first (default 1)")
        p.add_argument("--json", dest="json_out", default=None, help="write the report here")
    args = parser.parse_args(argv)

    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    try:
        conversations = load_loops(args.workload, args.conversations.split(",") if args.conversations else None)
        if args.engine == "vllm":
            head = Path(args.head).expanduser().resolve()
            if not (head / "config.json").is_file():
                raise ValueError(f"--head: {head} holds no config.json (a folder `draft train --layout eagle3` wrote)")
            eager = ["--enforce-eager"] if args.eager else []
            spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": args.k}
            specs = [TargetSpec("vllm", args=eager), TargetSpec("vllm-ngram", args=eager),
                     TargetSpec("vllm-eagle3", args=[*eager, "--speculative-config", json.dumps(spec)])]
        else:
            heads = parse_heads(args.head)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with tempfile.TemporaryDirectory(prefix="eagle3-heads-") as tmp:
        providers = None
        if args.engine == "embedded" and args.threads != 2:
            providers = Path(tmp) / "providers.yaml"
            providers.write_text(LOCAL_PROVIDERS.format(threads=args.threads))
        with Servers(providers=str(providers) if providers else None, threads=args.threads, log=say) as servers:
            report = run_servers(servers, args, specs if args.engine == "vllm" else heads, Path(tmp), conversations, say)
    report["settings"] = {k: v for k, v in vars(args).items() if k != "json_out"}
    print(format_report(report))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=2))
    return 0


def run_servers(servers: Servers, args: argparse.Namespace, what, tmp: Path, conversations, say) -> dict[str, Any]:
    """Start the targets (vLLM specs, or a sidecar per head after `off`) and measure them."""
    specs = what
    if args.engine == "embedded":
        specs = [TargetSpec("off")]
        for name, folder in what:
            policy = tmp / f"{name}.yaml"
            policy.write_text(head_policy(name, folder, args.gamma))
            specs.append(TargetSpec(name, sidecar="policy", args=["--policy", str(policy)]))
    targets = [servers.start(s) for s in specs]
    vllm_names = {t.name for t in targets} if args.engine == "vllm" else set()
    return measure(conversations, targets, vllm_names, args.repeat, args.warmup, say)


if __name__ == "__main__":
    sys.exit(main())
