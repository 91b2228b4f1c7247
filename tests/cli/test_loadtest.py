"""`openalice-runner loadtest` as a command against a sidecar on loopback (the tiny random model): a short
run where every request is served or refused with 429, nothing fails, and the report holds the figures.
The 60 s runs against the real default model are scripts/loadtest.sh, not a test."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from locations import REPO
from stand_ins.engines import tiny_engine
from support.live_server import LiveServer

from openalice_runner.cli.loadtest import check_loopback, percentiles
from openalice_runner.providers.config import load_routing_text
from openalice_runner.runner import Runner
from openalice_runner.server.app import create_app


def _server(max_queue: int) -> LiveServer:
    providers = (
        "providers:\n  local: {type: local, tiny_random: true, max_tokens_default: 4, "
        f"max_in_flight: 1, max_queue: {max_queue}}}\nroutes:\n  - {{name: default, chain: [local]}}\n"
    )
    runner = Runner.from_config(
        providers=load_routing_text(providers), policy=False, telemetry=False, engine=tiny_engine()
    )
    return LiveServer(create_app(runner)).start()


def _loadtest(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "openalice_runner", "loadtest", *args],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


@pytest.mark.parametrize(("max_queue", "refusals"), [(8, False), (1, True)])
def test_short_load_test_serves_or_refuses_every_request(tmp_path, max_queue, refusals):
    server = _server(max_queue)
    out = tmp_path / "report.json"
    try:
        done = _loadtest(
            "--url", server.url, "--concurrency", "4", "--duration", "5", "--max-tokens", "4",
            "--json", str(out), "--server-pid", str(os.getpid()),
        )  # fmt: skip
    finally:
        server.stop()
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    assert report["failed"] == 0 and report["server_errors"] == 0
    assert report["sent"] == report["succeeded"] + report["refused"] > 0
    assert set(report["statuses"]) <= {"200", "429"}
    assert (report["refused"] > 0) == refusals  # 4 workers, 1 slot + 1 queue place: some are refused
    assert report["streamed"] > 0 and report["ttft_s"]["p50"] <= report["latency_s"]["p50"]
    assert report["latency_s"]["p50"] <= report["latency_s"]["p95"] <= report["latency_s"]["p99"]
    assert report["server_peak_rss_bytes"] > 0
    assert "p50" in done.stdout and "refused(429)" in done.stdout


@pytest.mark.parametrize(
    "url",
    ["http://10.0.0.5:8000", "http://example.com", "http://169.254.1.1", "ftp://127.0.0.1", "127.0.0.1:80"],
)
def test_refuses_anything_but_loopback(url):
    with pytest.raises(ValueError):
        check_loopback(url)
    done = _loadtest("--url", url, "--duration", "1")
    assert done.returncode == 2 and "error:" in done.stderr


@pytest.mark.parametrize(
    "url", ["http://127.0.0.1:8000/", "http://localhost:1", "http://[::1]:9", "http://127.9.9.9"]
)
def test_accepts_loopback(url):
    assert check_loopback(url) == url.rstrip("/")


@pytest.mark.parametrize(("flag", "value"), [("--concurrency", "0"), ("--concurrency", "1000"), ("--duration", "0"),
                                              ("--duration", "99999"), ("--stream-ratio", "2")])  # fmt: skip
def test_bounds_are_enforced(flag, value):
    done = _loadtest("--url", "http://127.0.0.1:9", flag, value)
    assert done.returncode == 2 and "error:" in done.stderr


def test_percentiles_nearest_rank():
    stats = percentiles([float(i) for i in range(1, 101)])
    assert (stats["p50"], stats["p95"], stats["p99"], stats["max"]) == (50.0, 95.0, 99.0, 100.0)
    assert percentiles([]) is None
