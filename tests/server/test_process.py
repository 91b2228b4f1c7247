"""`openalice-runner serve` as a real process: a real Prometheus scrapes it, SIGTERM flushes its trace
file, its logs are JSON lines with trace ids, and `trace report` reads what it wrote."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from locations import REPO
from stand_ins.processes import free_port, wait_http
from tiers import missing

API_KEY = "process-key"
N_PLAIN, N_STREAM = 3, 2


class ServeProcess:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.port = free_port()
        self.trace_file = tmp / "trace.jsonl"
        self.log_file = tmp / "serve.log"
        providers = tmp / "providers.yaml"
        providers.write_text(
            "providers:\n  local: {type: local, tiny_random: true, max_tokens_default: 8}\n"
            "routes:\n  - {name: default, chain: [local]}\n"
        )
        policy = tmp / "policy.yaml"
        shutil.copy(REPO / "policies" / "default.yaml", policy)
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "OPENALICE_API_KEY": API_KEY, "PYTHONPATH": str(REPO)}
        cmd = [sys.executable, "-m", "openalice_runner", "serve", "--port", str(self.port),
               "--providers", str(providers), "--policy", str(policy), "--trace-file", str(self.trace_file)]  # fmt: skip
        self._log = self.log_file.open("wb")
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=self._log, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{self.port}"
        wait_http(f"{self.url}/health", self.proc)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    server = ServeProcess(tmp_path_factory.mktemp("serve"))
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
    for i in range(N_PLAIN):
        client.chat.completions.create(
            model="tiny-random", messages=[{"role": "user", "content": f"hello {i}"}], max_tokens=4,
            extra_headers={"X-OpenAlice-Turn-Type": "chat"},
        )  # fmt: skip
    for i in range(N_STREAM):
        list(
            client.chat.completions.create(
                model="tiny-random", messages=[{"role": "user", "content": f"stream {i}"}], max_tokens=4, stream=True,
                extra_headers={"X-OpenAlice-Turn-Type": "summarize"},
            )
        )  # fmt: skip
    yield server
    server.stop()


def test_real_prometheus_scrapes_the_request_count(served, tmp_path):
    binary = shutil.which("prometheus")
    if binary is None:
        missing("the `prometheus` binary is not installed (Debian package `prometheus`)")
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        "scrape_configs:\n  - job_name: openalice\n"
        f"    authorization: {{credentials: {API_KEY}}}\n"  # /metrics takes the API key when one is set
        f"    static_configs:\n      - targets: ['127.0.0.1:{served.port}']\n"
    )
    port = free_port()
    log = (tmp_path / "prometheus.log").open("wb")
    prom = subprocess.Popen(
        [binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        api = f"http://127.0.0.1:{port}/api/v1"
        wait_http(f"http://127.0.0.1:{port}/-/ready", prom)
        query = 'sum(openalice_chat_completions_total{outcome="ok"})'
        deadline = time.monotonic() + 30
        value = None
        while time.monotonic() < deadline:
            data = httpx.get(f"{api}/query", params={"query": query}, timeout=5).json()
            assert data["status"] == "success", data
            if data["data"]["result"]:
                value = float(data["data"]["result"][0]["value"][1])
                if value == N_PLAIN + N_STREAM:
                    break
            time.sleep(0.5)
        assert value == N_PLAIN + N_STREAM
        by_type = httpx.get(
            f"{api}/query",
            params={"query": "sum by (turn_type) (openalice_chat_completions_total)"},
            timeout=5,
        ).json()["data"]["result"]
        counts = {r["metric"]["turn_type"]: float(r["value"][1]) for r in by_type}
        assert counts == {"chat": N_PLAIN, "summarize": N_STREAM}
        # The GenAI histogram arrives too, labelled as the conventions name it.
        hist = httpx.get(
            f"{api}/query", params={"query": "sum(gen_ai_client_operation_duration_seconds_count)"}, timeout=5
        ).json()["data"]["result"]
        assert float(hist[0]["value"][1]) == N_PLAIN + N_STREAM
    finally:
        prom.terminate()
        prom.wait(timeout=15)
        log.close()


def test_sigterm_exits_cleanly_and_flushes_the_trace_file(served):
    assert served.stop() == 0
    spans = [json.loads(line) for line in served.trace_file.read_text().splitlines()]
    turns = [s for s in spans if s["attributes"].get("gen_ai.operation.name") == "invoke_agent"]
    chats = [s for s in spans if s["attributes"].get("gen_ai.operation.name") == "chat"]
    assert len(turns) == len(chats) == N_PLAIN + N_STREAM
    turn_ids = {t["span_id"] for t in turns}
    assert all(c["parent_id"] in turn_ids and c["kind"] == "CLIENT" for c in chats)
    for span in spans:
        assert {"trace_id", "span_id", "parent_id", "name", "kind", "start_ns", "end_ns", "attributes",
                "status", "events"} <= set(span)  # fmt: skip
        assert span["end_ns"] >= span["start_ns"]

    # Logs: JSON lines; each request line carries its turn's trace id.
    lines = [json.loads(x) for x in served.log_file.read_text().splitlines() if x.startswith("{")]
    requests = [x for x in lines if x.get("event") == "request" and x.get("path") == "/v1/chat/completions"]
    assert len(requests) == N_PLAIN + N_STREAM
    assert {x["trace_id"] for x in requests} == {t["trace_id"] for t in turns}

    report = subprocess.run(
        [sys.executable, "-m", "openalice_runner", "trace", "report", str(served.trace_file), "--json"],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, check=True,
    )  # fmt: skip
    data = json.loads(report.stdout)
    counts = {(r["turn_type"], r["kind"]): r["count"] for r in data["steps"]}
    assert counts == {("chat", "chat"): N_PLAIN, ("summarize", "chat"): N_STREAM}
