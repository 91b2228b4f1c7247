"""`openalice-runner loadtest`: a bounded, self-stopping load generator for a sidecar on loopback.

N workers send chat completions back to back for D seconds (half of them streamed, by default), then
stop sending and wait for what is in flight. Each request ends as one of: succeeded (200 with a whole
answer: a streamed one ends in `[DONE]` with no error event), refused (429; the worker then waits the
Retry-After it was given, as a well-behaved client does), or failed (anything else: another status, a
broken stream, a connection error, a client-side timeout). Reports p50/p95/p99 latency of the
successes and time to first token of the streamed ones; `--server-pid` adds the server's peak RSS.

Loopback only, and every knob is capped: this is for checking a server on this machine, not a way to
load someone else's.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

MAX_CONCURRENCY = 256
MAX_DURATION_S = 3600.0
DEFAULT_PROMPTS = (
    "Say hello in one short sentence.",
    "List three colours.",
    "What is 12 times 7? Answer briefly.",
    "Name a planet and one fact about it.",
    "Write a haiku about tea.",
    "Give one tip for writing clear code.",
)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("loadtest", help="bounded load test of a sidecar on loopback")
    p.add_argument(
        "--url", required=True, help="the sidecar's base URL, e.g. http://127.0.0.1:8000 (loopback only)"
    )
    p.add_argument("--concurrency", type=int, default=4, help=f"workers (1..{MAX_CONCURRENCY}, default 4)")
    p.add_argument("--duration", type=float, default=10.0, help="seconds of sending (default 10)")
    p.add_argument(
        "--workload", metavar="FILE",
        help="JSON lines, one request each: `messages` (required), optional `max_tokens`, `tools`, "
        "`stream`, `turn_type` (sent as X-OpenAlice-Turn-Type), `context` (the bench workload format); "
        "default: short chat prompts",
    )  # fmt: skip
    p.add_argument("--json", metavar="OUT", help="write the report as JSON to OUT")
    p.add_argument("--max-tokens", type=int, default=32, help="max_tokens where the workload sets none")
    p.add_argument("--stream-ratio", type=float, default=0.5, help="share of requests streamed (0..1)")
    p.add_argument("--request-timeout", type=float, default=120.0, help="client-side limit per request (s)")
    p.add_argument("--api-key", help="sent as Authorization: Bearer KEY (default: $OPENALICE_API_KEY)")
    p.add_argument("--model", help="the `model` field (default: none, the server's default route)")
    p.add_argument("--server-pid", type=int, help="read this process's peak RSS (VmHWM) at the end")
    p.set_defaults(func=run)


# ---------------------------------------------------------------- arguments


def check_loopback(url: str) -> str:
    """The URL without a trailing slash, or ValueError unless it points at this machine's loopback."""
    parsed = urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise ValueError(f"--url must be an http(s) URL, got {url!r}")
    host = parsed.hostname
    if host != "localhost":
        try:
            loopback = ipaddress.ip_address(host).is_loopback
        except ValueError:
            loopback = False  # a name other than localhost: not resolved, not trusted
        if not loopback:
            raise ValueError(f"--url must be on loopback (127.0.0.0/8, ::1 or localhost), got host {host!r}")
    return url.rstrip("/")


def _check_args(args: argparse.Namespace) -> None:
    if not 1 <= args.concurrency <= MAX_CONCURRENCY:
        raise ValueError(f"--concurrency must be between 1 and {MAX_CONCURRENCY}")
    if not 0 < args.duration <= MAX_DURATION_S:
        raise ValueError(f"--duration must be between 0 and {MAX_DURATION_S:g} seconds")
    if not 0 <= args.stream_ratio <= 1:
        raise ValueError("--stream-ratio must be between 0 and 1")
    if not 0 < args.request_timeout <= MAX_DURATION_S:
        raise ValueError("--request-timeout must be positive")
    if args.max_tokens < 1:
        raise ValueError("--max-tokens must be at least 1")


@dataclass
class Item:
    body: dict[str, Any]
    headers: dict[str, str]
    stream: bool | None  # None: decided by --stream-ratio


def load_items(path: str | None, max_tokens: int, model: str | None) -> list[Item]:
    if path is None:
        raws: list[dict[str, Any]] = [{"messages": [{"role": "user", "content": p}]} for p in DEFAULT_PROMPTS]
    else:
        raws = []
        for n, line in enumerate(Path(path).read_text().splitlines(), start=1):
            if not line.strip():
                continue
            try:
                raw = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{n}: not JSON: {exc}") from None
            if not isinstance(raw, dict) or not isinstance(raw.get("messages"), list):
                raise ValueError(f"{path}:{n}: each line must be an object with a `messages` list")
            raws.append(raw)
        if not raws:
            raise ValueError(f"{path}: no requests in the workload")
    return [_item(raw, max_tokens, model) for raw in raws]


def _item(raw: dict[str, Any], max_tokens: int, model: str | None) -> Item:
    raw = dict(raw)
    headers = {}
    turn_type = raw.pop("turn_type", None)
    if turn_type:
        headers["X-OpenAlice-Turn-Type"] = str(turn_type)
    context = raw.pop("context", None)
    raw.pop("id", None)
    if context:
        from openalice_runner.workload_files import stdlib_context

        text = stdlib_context(context)
        raw["messages"] = [
            {**m, "content": m["content"].replace("{context}", text)}
            if isinstance(m.get("content"), str)
            else m
            for m in raw["messages"]
        ]
    raw.setdefault("max_tokens", max_tokens)
    if model:
        raw.setdefault("model", model)
    stream = raw.pop("stream", None)
    raw.pop("stream_options", None)
    return Item(raw, headers, stream if isinstance(stream, bool) else None)


# ---------------------------------------------------------------- the run


@dataclass
class Tally:
    sent: int = 0
    succeeded: int = 0
    refused: int = 0
    failed: int = 0
    streamed: int = 0
    completion_tokens: int = 0
    statuses: dict[str, int] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)
    latencies: list[float] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)

    def fail(self, kind: str) -> None:
        self.failed += 1
        self.errors[kind] = self.errors.get(kind, 0) + 1


class LoadTest:
    def __init__(self, args: argparse.Namespace, base: str, items: list[Item], api_key: str | None) -> None:
        self.args = args
        self.url = f"{base}/v1/chat/completions"
        self.items = items
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.tally = Tally()
        self._next = 0

    def _pick(self) -> tuple[Item, bool]:
        n = self._next
        self._next += 1
        item = self.items[n % len(self.items)]
        # Streams spread evenly: request n streams when the running share falls below the ratio.
        stream = item.stream
        if stream is None:
            ratio = self.args.stream_ratio
            stream = int((n + 1) * ratio) > int(n * ratio)
        return item, stream

    async def run(self) -> dict[str, Any]:
        import httpx

        limits = httpx.Limits(
            max_connections=self.args.concurrency, max_keepalive_connections=self.args.concurrency
        )
        timeout = httpx.Timeout(self.args.request_timeout, connect=5.0)
        t0 = time.perf_counter()
        stop_at = t0 + self.args.duration
        async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False) as client:
            await asyncio.gather(*(self._worker(client, stop_at) for _ in range(self.args.concurrency)))
        return report(self.args, self.tally, time.perf_counter() - t0)

    async def _worker(self, client: Any, stop_at: float) -> None:
        while time.perf_counter() < stop_at:
            item, stream = self._pick()
            retry_after = await self._one(client, item, stream)
            if retry_after:
                await asyncio.sleep(max(0.0, min(retry_after, stop_at - time.perf_counter())))

    async def _one(self, client: Any, item: Item, stream: bool) -> float | None:
        """One request; returns the Retry-After to honour after a 429."""
        import httpx

        body = {**item.body, "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
        headers = {**self.headers, **item.headers}
        tally = self.tally
        tally.sent += 1
        t0 = time.perf_counter()
        try:
            async with client.stream("POST", self.url, json=body, headers=headers) as response:
                status = response.status_code
                tally.statuses[str(status)] = tally.statuses.get(str(status), 0) + 1
                if status == 429:
                    await response.aread()
                    tally.refused += 1
                    return _seconds(response.headers.get("retry-after"))
                if status != 200:
                    await response.aread()
                    tally.fail(f"http_{status}")
                    return None
                if stream:
                    ok, ttft, tokens = await _read_stream(response, t0)
                    if not ok:
                        tally.fail("stream_error")
                        return None
                    tally.streamed += 1
                    if ttft is not None:
                        tally.ttfts.append(ttft)
                else:
                    data = json.loads(await response.aread())
                    tokens = int((data.get("usage") or {}).get("completion_tokens") or 0)
        except httpx.TimeoutException:
            tally.fail("timeout")
            return None
        except (httpx.HTTPError, ValueError) as exc:
            tally.fail(type(exc).__name__)
            return None
        tally.succeeded += 1
        tally.completion_tokens += tokens
        tally.latencies.append(time.perf_counter() - t0)
        return None


async def _read_stream(response: Any, t0: float) -> tuple[bool, float | None, int]:
    """(whole and error-free, time to first content, completion tokens from the usage chunk)."""
    ttft = None
    tokens = 0
    done = False
    async for line in response.aiter_lines():
        if not line.startswith("data: "):
            continue
        payload = line[6:]
        if payload == "[DONE]":
            done = True
            break
        event = json.loads(payload)
        if "error" in event:
            return False, ttft, tokens
        for choice in event.get("choices") or ():
            delta = choice.get("delta") or {}
            if ttft is None and (delta.get("content") or delta.get("tool_calls")):
                ttft = time.perf_counter() - t0
        usage = event.get("usage")
        if usage:
            tokens = int(usage.get("completion_tokens") or 0)
    return done, ttft, tokens


def _seconds(value: str | None) -> float:
    try:
        return max(0.0, float(value)) if value is not None else 1.0
    except ValueError:
        return 1.0


# ---------------------------------------------------------------- report


def percentiles(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    ordered = sorted(values)

    def rank(q: float) -> float:  # nearest rank: the smallest value with at least q of them at or below
        return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]

    return {
        "p50": rank(0.50),
        "p95": rank(0.95),
        "p99": rank(0.99),
        "mean": sum(ordered) / len(ordered),
        "max": ordered[-1],
    }


def peak_rss_bytes(pid: int) -> int | None:
    """VmHWM (the peak resident set) of a process on this machine, from /proc."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def report(args: argparse.Namespace, tally: Tally, elapsed: float) -> dict[str, Any]:
    server_errors = sum(n for status, n in tally.statuses.items() if status.startswith("5"))
    out: dict[str, Any] = {
        "url": args.url,
        "concurrency": args.concurrency,
        "duration_s": args.duration,
        "elapsed_s": round(elapsed, 3),
        "sent": tally.sent,
        "succeeded": tally.succeeded,
        "refused": tally.refused,
        "failed": tally.failed,
        "server_errors": server_errors,
        "statuses": dict(sorted(tally.statuses.items())),
        "errors": dict(sorted(tally.errors.items())),
        "streamed": tally.streamed,
        "latency_s": percentiles(tally.latencies),
        "ttft_s": percentiles(tally.ttfts),
        "completion_tokens": tally.completion_tokens,
        "requests_per_s": round(tally.succeeded / elapsed, 3) if elapsed > 0 else None,
        "tokens_per_s": round(tally.completion_tokens / elapsed, 2) if elapsed > 0 else None,
    }
    if args.server_pid:
        out["server_pid"] = args.server_pid
        out["server_peak_rss_bytes"] = peak_rss_bytes(args.server_pid)
    return out


def format_table(r: dict[str, Any]) -> str:
    def ms(stats: dict[str, float] | None, key: str) -> str:
        return f"{stats[key] * 1000:.0f}" if stats else "-"

    lines = [
        f"url {r['url']}  concurrency {r['concurrency']}  duration {r['duration_s']:g}s  elapsed {r['elapsed_s']:.1f}s",
        f"sent {r['sent']}  succeeded {r['succeeded']}  refused(429) {r['refused']}  failed {r['failed']}  "
        f"5xx {r['server_errors']}  streamed {r['streamed']}",
        f"latency ms  p50 {ms(r['latency_s'], 'p50')}  p95 {ms(r['latency_s'], 'p95')}  p99 {ms(r['latency_s'], 'p99')}",
        f"ttft ms     p50 {ms(r['ttft_s'], 'p50')}  p95 {ms(r['ttft_s'], 'p95')}  p99 {ms(r['ttft_s'], 'p99')}",
        f"throughput  {r['requests_per_s']} req/s  {r['tokens_per_s']} tokens/s",
    ]
    if r.get("errors"):
        lines.append("errors " + ", ".join(f"{k}: {v}" for k, v in r["errors"].items()))
    if r.get("server_peak_rss_bytes") is not None:
        lines.append(f"server peak RSS {r['server_peak_rss_bytes'] / 2**20:.0f} MiB (pid {r['server_pid']})")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    import os

    try:
        base = check_loopback(args.url)
        _check_args(args)
        items = load_items(args.workload, args.max_tokens, args.model)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    api_key = args.api_key or os.environ.get("OPENALICE_API_KEY") or None
    result = asyncio.run(LoadTest(args, base, items, api_key).run())
    print(format_table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 1 if result["failed"] or result["server_errors"] else 0
