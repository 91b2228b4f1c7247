"""What the runner in front of a server costs per call: the same request to the runner and to the
server it routes to, alternating, paired call by call.

    python -m openalice_runner.bench.front_overhead --front http://127.0.0.1:8000 \
        --direct http://127.0.0.1:8112 [--n 201] [--max-tokens 1] [--stream]

The front must route the request to the direct server (a policy that sends it to that pool): the
replies are compared, and a pair whose outputs differ is counted and left out. Each pair runs the
two calls back to back in alternating order, so drift hits both alike. Every call sends the same
request, so after the warm-up each one finds its prompt in the server's prefix cache on either
path: both sides do the same work (the last prompt token and the reply).
Printed: the medians of each side's latency (TTFT when streamed, whole call otherwise) and the
median of the paired differences (front minus direct).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

PROMPT = "Reply with one word: which planet is closest to the sun?"


def _call(client, base: str, model: str, max_tokens: int, stream: bool) -> tuple[float, str]:
    body = {"model": model, "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    t0 = time.perf_counter()
    if not stream:
        response = client.post(f"{base}/v1/chat/completions", json=body)
        response.raise_for_status()
        return time.perf_counter() - t0, response.json()["choices"][0]["message"]["content"] or ""
    first, text = None, []
    with client.stream("POST", f"{base}/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            delta = (json.loads(line[6:]).get("choices") or [{}])[0].get("delta") or {}
            if delta.get("content"):
                first = first or time.perf_counter() - t0
                text.append(delta["content"])
    return (first if first is not None else time.perf_counter() - t0), "".join(text)


def _model(client, base: str) -> str:
    return client.get(f"{base}/v1/models").json()["data"][0]["id"]


def measure(front: str, direct: str, n: int, max_tokens: int, stream: bool, warmup: int = 5) -> dict:
    import httpx

    with httpx.Client(timeout=httpx.Timeout(120.0, connect=10.0)) as client:
        models = {front: _model(client, front), direct: _model(client, direct)}
        for _ in range(warmup):
            for base in (front, direct):
                _call(client, base, models[base], max_tokens, stream)
        deltas, fronts, directs, differ = [], [], [], 0
        for k in range(n):
            order = (front, direct) if k % 2 == 0 else (direct, front)
            got = {base: _call(client, base, models[base], max_tokens, stream) for base in order}
            if got[front][1] != got[direct][1]:
                differ += 1
                continue
            fronts.append(got[front][0])
            directs.append(got[direct][0])
            deltas.append(got[front][0] - got[direct][0])
    if not deltas:
        raise RuntimeError(f"no pair of the {n} had the same output on both sides: is the front routing to {direct}?")
    return {
        "pairs": len(deltas), "outputs_differed": differ, "stream": stream, "max_tokens": max_tokens,
        "front_p50_ms": round(1000 * statistics.median(fronts), 2),
        "direct_p50_ms": round(1000 * statistics.median(directs), 2),
        "overhead_p50_ms": round(1000 * statistics.median(deltas), 2),
        "overhead_p90_ms": round(1000 * statistics.quantiles(deltas, n=10)[-1], 2) if len(deltas) > 1 else None,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--front", required=True, help="the runner's base URL (without /v1)")
    parser.add_argument("--direct", required=True, help="the server it routes to (without /v1)")
    parser.add_argument("--n", type=int, default=201, help="pairs (default 201)")
    parser.add_argument("--max-tokens", type=int, default=1)
    parser.add_argument("--stream", action="store_true", help="streamed calls; latency is the first token's")
    args = parser.parse_args(argv)
    if args.n < 1 or args.max_tokens < 1:
        parser.error("--n and --max-tokens must be 1 or more")
    front, direct = args.front.rstrip("/").removesuffix("/v1"), args.direct.rstrip("/").removesuffix("/v1")
    print(json.dumps(measure(front, direct, args.n, args.max_tokens, args.stream)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
