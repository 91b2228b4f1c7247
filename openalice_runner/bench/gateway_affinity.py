"""How much of an agent loop's later prompts two vLLM workers serve from cache behind smg, per policy.

    python -m openalice_runner.bench.gateway_affinity --workload ../shared/workloads/agent-loops.jsonl \
        --workers http://127.0.0.1:8120,http://127.0.0.1:8121 --policies round_robin,cache_aware,prefix_hash,consistent_hashing

The workers are vLLM servers already running (prefix caching on, `--enable-prompt-tokens-details`,
started in dev mode, `VLLM_SERVER_DEV_MODE=1`, so their caches can be emptied between policies
with `POST /reset_prefix_cache`); smg is started here in front of them, once per policy
(`smg launch --worker-urls A B --backend vllm --policy P`). `consistent_hashing` is keyed on the
loop's conversation id header (`--routing-key-headers x-openalice-conversation-id`); the others see
only the request. The conversations run as bench-loops drives them (loops.run_conversation),
`--parallel` at a time, with budgets capped at `--max-tokens`; each policy's runs open with a
session line of their own, so nothing one policy cached helps the next even without the reset.

Per policy: the share of later calls' prompt tokens (every call after a conversation's first)
that the worker served from its cache (usage.prompt_tokens_details.cached_tokens), against the
most it could (`reachable`: the tokens the previous call sent and got back, in whole cache blocks
of `--block-size`: vLLM caches whole blocks only), and first calls' share for reference.

`--direct URL=NAME` adds a row measured through an endpoint already running in front of the same
workers instead of smg: the runner (`openalice-runner serve` with a `type: vllm` pool listing both
workers as replicas), whose own replica choice keeps a conversation on its replica
(`X-OpenAlice-Conversation-Id`, rendezvous hashing bounded by load).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from openalice_runner.bench.loop_targets import free_port
from openalice_runner.bench.loops import Conversation, Target, load_loops, run_conversation

POLICIES = ("round_robin", "cache_aware", "prefix_hash", "consistent_hashing")
ROUTING_HEADER = "x-openalice-conversation-id"  # what run_conversation sends per conversation run


def smg_binary() -> Path:
    if os.environ.get("OPENALICE_SMG"):
        return Path(os.environ["OPENALICE_SMG"])
    if os.environ.get("OPENALICE_SMG_VENV"):  # as scripts/smg-venv.sh reads it
        return Path(os.environ["OPENALICE_SMG_VENV"]) / "bin" / "smg"
    cache = Path(os.environ.get("OPENALICE_CACHE_DIR") or Path.home() / ".cache" / "openalice-runner")
    return cache / "venvs" / "smg" / "bin" / "smg"


def smg_command(policy: str, workers: list[str], port: int) -> list[str]:
    command = [str(smg_binary()), "launch", "--host", "127.0.0.1", "--port", str(port),
               "--worker-urls", *workers, "--backend", "vllm", "--policy", policy, "--log-level", "warn"]
    if policy == "consistent_hashing":
        command += ["--routing-key-headers", ROUTING_HEADER]
    return command


@contextlib.contextmanager
def gateway(policy: str, workers: list[str], log_dir: Path, startup_s: float = 120.0):
    import httpx

    port = free_port()
    log_path = log_dir / f"smg-{policy}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(smg_command(policy, workers, port), stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + startup_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"smg ({policy}) exited with {proc.returncode}: {log_path.read_text()[-2000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=5).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"smg ({policy}) not ready after {startup_s:.0f} s (log: {log_path})")
            time.sleep(0.5)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def capped(conversation: Conversation, max_tokens: int) -> Conversation:
    steps = [dataclasses.replace(s, call=dataclasses.replace(s.call, max_tokens=min(s.call.max_tokens, max_tokens)))
             if s.call else s for s in conversation.steps]
    return dataclasses.replace(conversation, steps=steps)


def reset_caches(client, workers: list[str]) -> None:
    for url in workers:
        response = client.post(f"{url}/reset_prefix_cache")
        if response.status_code != 200:
            raise RuntimeError(f"{url}/reset_prefix_cache: HTTP {response.status_code} (start the worker with "
                               "VLLM_SERVER_DEV_MODE=1): {response.text[:200]}")


def cache_counters(client, workers: list[str]) -> tuple[float, float]:
    """Prefix-cache hits and queries (tokens) summed over the workers' /metrics: a check on the
    usage figures that counts every call, whichever worker served it."""
    hits = queries = 0.0
    for url in workers:
        for line in client.get(f"{url}/metrics").text.splitlines():
            if line.startswith("vllm:prefix_cache_hits_total"):
                hits += float(line.rsplit(" ", 1)[1])
            elif line.startswith("vllm:prefix_cache_queries_total"):
                queries += float(line.rsplit(" ", 1)[1])
    return hits, queries


def share(cached: int, total: int) -> float | None:
    return round(cached / total, 3) if total else None


def measure(policy: str, conversations: list[Conversation], workers: list[str], run: int, parallel: int,
            block: int, log_dir: Path, direct: str | None = None) -> dict:
    import httpx

    with httpx.Client(timeout=httpx.Timeout(600.0, connect=10.0)) as client:
        reset_caches(client, workers)
        hits0, queries0 = cache_counters(client, workers)
        with contextlib.nullcontext(direct) if direct else gateway(policy, workers, log_dir) as url:
            target = Target(policy, url)
            target.model = client.get(f"{url}/models").json()["data"][0]["id"]
            t0 = time.perf_counter()
            with ThreadPoolExecutor(parallel) as pool:
                done = list(pool.map(lambda c: run_conversation(client, target, c, run), conversations))
            seconds = time.perf_counter() - t0
        hits1, queries1 = cache_counters(client, workers)
    first = {"prompt": 0, "cached": 0}
    later = {"prompt": 0, "cached": 0, "reachable": 0}
    for record in done:
        calls = record["calls"]
        if any(c.prompt_tokens is None or c.cached_tokens is None for c in calls):
            raise RuntimeError(f"{policy}: a call without prompt_tokens_details.cached_tokens "
                               "(start the workers with --enable-prompt-tokens-details)")
        first["prompt"] += calls[0].prompt_tokens
        first["cached"] += calls[0].cached_tokens
        for before, call in zip(calls, calls[1:], strict=False):
            later["prompt"] += call.prompt_tokens
            later["cached"] += call.cached_tokens
            sent_back = min(call.prompt_tokens - 1, before.prompt_tokens + (before.completion_tokens or 0))
            later["reachable"] += sent_back // block * block
    return {
        "policy": policy,
        "conversations": len(done),
        "calls": sum(len(r["calls"]) for r in done),
        "seconds": round(seconds, 2),
        "later_prompt_tokens": later["prompt"],
        "later_cached_tokens": later["cached"],
        "later_cached_share": share(later["cached"], later["prompt"]),
        "later_reachable_share": share(later["reachable"], later["prompt"]),
        "first_cached_share": share(first["cached"], first["prompt"]),
        "all_calls_hit_share_metrics": share(hits1 - hits0, queries1 - queries0),
        "per_conversation": [{"id": r["id"], "cached": [c.cached_tokens for c in r["calls"]],
                              "prompt": [c.prompt_tokens for c in r["calls"]]} for r in done],
    }


def format_table(rows: list[dict]) -> str:
    lines = ["| policy | later calls' prompt tokens | served from cache | share | most reachable | of reachable "
             "| first calls' share | all calls, /metrics | wall s |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        of = share(r["later_cached_share"] or 0, r["later_reachable_share"] or 0)
        lines.append(f"| {r['policy']} | {r['later_prompt_tokens']} | {r['later_cached_tokens']} | "
                     f"{r['later_cached_share']} | {r['later_reachable_share']} | {of} | {r['first_cached_share']} | "
                     f"{r['all_calls_hit_share_metrics']} | {r['seconds']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m openalice_runner.bench.gateway_affinity", description=__doc__.split("\n")[0])
    p.add_argument("--workload", required=True)
    p.add_argument("--workers", required=True, help="comma-separated worker base URLs (no /v1)")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--conversations", default=None, help="comma-separated ids (default: all)")
    p.add_argument("--max-tokens", type=int, default=16, help="cap on every call's budget")
    p.add_argument("--parallel", type=int, default=2, help="conversations running at once")
    p.add_argument("--block-size", type=int, default=128,
                   help="the workers' KV cache block: vLLM CPU's default is 128 (--block-size, multiples of 32)")
    p.add_argument("--direct", action="append", default=[], metavar="URL=NAME",
                   help="also measure through this running endpoint (API base ending in /v1), e.g. the runner")
    p.add_argument("--json", dest="json_out", default=None)
    args = p.parse_args(argv)
    workers = [u.rstrip("/") for u in args.workers.split(",") if u.strip()]
    policies = [x for x in args.policies.split(",") if x]
    unknown = [x for x in policies if x not in POLICIES]
    direct = [tuple(d.rsplit("=", 1)) for d in args.direct]
    if len(workers) < 2 or unknown or any(len(d) != 2 or not d[0].startswith("http") for d in direct):
        print(f"error: give two or more --workers, policies among {', '.join(POLICIES)}, --direct as URL=NAME",
              file=sys.stderr)
        return 2
    if policies and not smg_binary().exists():
        print(f"error: no smg at {smg_binary()}: pip install smg into that venv (or set OPENALICE_SMG)", file=sys.stderr)
        return 2
    conversations = load_loops(args.workload, args.conversations.split(",") if args.conversations else None)
    conversations = [capped(c, args.max_tokens) for c in conversations]
    log_dir = Path(os.environ.get("TMPDIR", "/tmp")) / "gateway-affinity"
    log_dir.mkdir(exist_ok=True)
    rows = []
    plan = [(policy, None) for policy in policies] + [(name, url.rstrip("/")) for url, name in direct]
    for run, (policy, url) in enumerate(plan):
        row = measure(policy, conversations, workers, run + 100, args.parallel, args.block_size, log_dir, url)
        print(f"{policy}: later calls {row['later_cached_tokens']}/{row['later_prompt_tokens']} cached "
              f"({row['later_cached_share']}), reachable {row['later_reachable_share']}", file=sys.stderr, flush=True)
        rows.append(row)
    print(format_table(rows))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"rows": rows, "settings": vars(args)}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
