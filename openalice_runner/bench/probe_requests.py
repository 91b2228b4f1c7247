"""The hostile probe's three requests, for the load test's memory check (issue 46): a 7 MB model
name, 8 MB of empty messages, a /metrics scrape. Each is answered (a 4xx for the first two, in
OpenAI's shape); the server's RSS is read after each, so the load test's peak covers them.

    python -m openalice_runner.bench.probe_requests URL PID OUT.json
"""

from __future__ import annotations

import json
import sys

import httpx

MODEL_NAME_BYTES = 7 * 10**6
EMPTY_MESSAGES_BYTES = 8 * 10**6
EMPTY = '{"role":"user","content":""},'


def rss_mib(pid: int) -> tuple[float, float]:
    """(VmRSS, VmHWM) of PID in MiB."""
    with open(f"/proc/{pid}/status") as f:
        fields = dict(line.split(":", 1) for line in f if ":" in line)
    return tuple(int(fields[k].split()[0]) / 1024 for k in ("VmRSS", "VmHWM"))  # type: ignore[return-value]


def probe(url: str, pid: int) -> list[dict]:
    hi = [{"role": "user", "content": "Hi"}]
    # 8 MB of empty messages written by hand: json.dumps of 260k dicts would be the client's own cost
    n = (EMPTY_MESSAGES_BYTES - 64) // len(EMPTY)
    empty_body = ('{"max_tokens":1,"messages":[' + EMPTY * n).rstrip(",") + "]}"
    requests = [
        ("7 MB model name", "POST", "/v1/chat/completions",
         json.dumps({"model": "m" * MODEL_NAME_BYTES, "messages": hi, "max_tokens": 1})),
        (f"{len(empty_body) / 1e6:.1f} MB of empty messages ({n})", "POST", "/v1/chat/completions", empty_body),
        ("/metrics scrape", "GET", "/metrics", None),
    ]
    rows = []
    with httpx.Client(timeout=httpx.Timeout(300.0, connect=10.0)) as client:
        for name, method, path, body in requests:
            response = client.request(method, url + path, content=body,
                                      headers={"content-type": "application/json"} if body else None)
            error = response.json().get("error") if response.status_code >= 400 else None
            rss, hwm = rss_mib(pid)
            rows.append({"request": name, "status": response.status_code, "bytes_sent": len(body or ""),
                         "error": error and {k: error.get(k) for k in ("type", "code", "param")},
                         "rss_mib_after": round(rss), "peak_rss_mib_after": round(hwm)})
    return rows


def main(argv: list[str] | None = None) -> int:
    url, pid, out = (argv or sys.argv[1:])[:3]
    rows = probe(url.rstrip("/"), int(pid))
    with open(out, "w") as f:
        json.dump(rows, f, indent=1)
    for row in rows:
        print(json.dumps(row))
    # the first two are client faults (4xx), the scrape a 200: anything else is the server's fault
    return 0 if [r["status"] // 100 for r in rows] == [4, 4, 2] else 1


if __name__ == "__main__":
    sys.exit(main())
