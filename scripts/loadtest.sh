#!/usr/bin/env bash
# Load test of the embedded default: `openalice-runner serve` with its defaults (SmolLM2-135M-Instruct,
# admission 8 in flight + 16 queued), then `openalice-runner loadtest` for DURATION seconds at each
# concurrency, then the memory check: four long prompts with deeply nested tool schemas and max_tokens
# 4000 at once (openalice_runner/bench/deep_tools_workload.py; DEEP_TOOLS=0 skips it), each allowed DEEP_TIMEOUT seconds
# (default 900) so the replies run to their end and the peak covers the whole KV cache they need; then
# two schema phases (openalice_runner/bench/schema_workloads.py; SCHEMAS=0 skips them), concurrency 4 for DURATION
# seconds each: `deep-schema` (tool parameters and response formats nested 30 objects deep, validated
# and compiled per request) and `large-grammar` (eight distinct response formats of 450 optional
# properties or 1,500 anyOf branches, in turn: the grammar cache keeps compiling and evicting); then the
# hostile probe's requests (a 7 MB model name, 8 MB of empty messages, a /metrics scrape; PROBE=0 skips
# them: openalice_runner/bench/probe_requests.py). Writes one JSON report per run
# and a Markdown table (sent/ok/429/failed/5xx, latency and time-to-first-token percentiles, the
# server's peak RSS from /proc/PID/status VmHWM, over every run); exits 1 when that peak is over 1.5 GiB.
#
#   scripts/loadtest.sh [OUT.md]            # default OUT: loadtest-results.md
#   DURATION=60 CONCURRENCY="1 4 16" PORT=8765 scripts/loadtest.sh /tmp/results.md
#
# Heavy: runs the real model for 3 x DURATION seconds. Not part of the test suite.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
OUT="${1:-loadtest-results.md}"
DURATION="${DURATION:-60}"
CONCURRENCY="${CONCURRENCY:-1 4 16}"
DEEP_TOOLS="${DEEP_TOOLS:-1}"
SCHEMAS="${SCHEMAS:-1}"
PROBE="${PROBE:-1}"
PROBE_FAILED=0
DEEP_TIMEOUT="${DEEP_TIMEOUT:-900}"
PORT="${PORT:-8765}"
PY="${PY:-$ROOT/.venv/bin/python}"
SERVE_ARGS="${SERVE_ARGS:-}"  # e.g. "--providers tiny.yaml" to try the script on the tiny model
WORK="$(mktemp -d)"
export HF_HUB_OFFLINE=1 PYTHONPATH="$ROOT"

# shellcheck disable=SC2086
"$PY" -m openalice_runner serve --port "$PORT" $SERVE_ARGS >"$WORK/serve.log" 2>&1 &
SERVER=$!
cleanup() { kill -TERM "$SERVER" 2>/dev/null || true; }
trap cleanup EXIT

for _ in $(seq 1 300); do
  if curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; then break; fi
  kill -0 "$SERVER" 2>/dev/null || { echo "serve exited:"; cat "$WORK/serve.log"; exit 1; }
  sleep 0.5
done
echo "server pid $SERVER up; $(grep VmRSS "/proc/$SERVER/status") with the model loaded"

for c in $CONCURRENCY; do
  echo "== concurrency $c, ${DURATION}s"
  "$PY" -m openalice_runner loadtest --url "http://127.0.0.1:$PORT" --concurrency "$c" \
    --duration "$DURATION" --server-pid "$SERVER" --json "$WORK/c$c.json" || true
done
LEVELS="$CONCURRENCY"
if [ "$DEEP_TOOLS" != 0 ]; then
  echo "== memory check: 4 long prompts with deep tool schemas at once, ${DURATION}s"
  "$PY" -m openalice_runner.bench.deep_tools_workload "$WORK/deep_tools.jsonl"
  "$PY" -m openalice_runner loadtest --url "http://127.0.0.1:$PORT" --concurrency 4 --workload "$WORK/deep_tools.jsonl" \
    --duration "$DURATION" --request-timeout "$DEEP_TIMEOUT" --server-pid "$SERVER" --json "$WORK/cdeep-tools.json" || true
  LEVELS="$LEVELS deep-tools"
fi
if [ "$SCHEMAS" != 0 ]; then
  "$PY" -m openalice_runner.bench.schema_workloads "$WORK"
  for phase in deep-schema large-grammar; do
    echo "== memory check: $phase, concurrency 4, ${DURATION}s"
    "$PY" -m openalice_runner loadtest --url "http://127.0.0.1:$PORT" --concurrency 4 --workload "$WORK/$phase.jsonl" \
      --duration "$DURATION" --request-timeout "$DEEP_TIMEOUT" --server-pid "$SERVER" --json "$WORK/c$phase.json" || true
    LEVELS="$LEVELS $phase"
  done
fi
if [ "$PROBE" != 0 ]; then
  echo "== memory check: the probe's requests (a 7 MB model name, 8 MB of empty messages, a /metrics scrape)"
  "$PY" -m openalice_runner.bench.probe_requests "http://127.0.0.1:$PORT" "$SERVER" "$WORK/probe.json" || PROBE_FAILED=1
fi
curl -s "http://127.0.0.1:$PORT/metrics" >"$WORK/metrics.txt"

kill -TERM "$SERVER"
set +e
wait "$SERVER"
EXIT=$?
set -e
trap - EXIT

"$PY" - "$WORK" "$OUT" "$EXIT" "$LEVELS" "$PROBE_FAILED" <<'EOF'
import json, sys
from pathlib import Path

RSS_BOUND = 1.5 * 2**30  # the memory check's bound on the server's peak RSS
work, out, exit_code, levels = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4].split()
probe_failed = sys.argv[5] == "1"
ms = lambda s, k: f"{s[k] * 1000:.0f}" if s else "-"
rows, peak = [], 0
for c in levels:
    r = json.loads((work / f"c{c}.json").read_text())
    peak = max(peak, r.get("server_peak_rss_bytes") or 0)
    lat, ttft = r["latency_s"], r["ttft_s"]
    rows.append(
        f"| {c} | {r['elapsed_s']:.0f} | {r['sent']} | {r['succeeded']} | {r['refused']} | {r['failed']} | "
        f"{r['server_errors']} | {ms(lat, 'p50')} / {ms(lat, 'p95')} / {ms(lat, 'p99')} | "
        f"{ms(ttft, 'p50')} / {ms(ttft, 'p95')} / {ms(ttft, 'p99')} | {r['requests_per_s']} | {r['tokens_per_s']} |"
    )
probe = json.loads((work / "probe.json").read_text()) if (work / "probe.json").is_file() else []
for p in probe:
    peak = max(peak, p["peak_rss_mib_after"] * 2**20)
probe_lines = [f"- {p['request']}: HTTP {p['status']} {(p['error'] or {}).get('param') or ''}, RSS after "
               f"{p['rss_mib_after']} MiB (peak {p['peak_rss_mib_after']} MiB)" for p in probe]
metrics = (work / "metrics.txt").read_text().splitlines()
fivexx = sum(float(l.rsplit(" ", 1)[1]) for l in metrics
             if l.startswith("openalice_http_requests_total{") and 'status="5' in l)
text = "\n".join([
    "# Load test: `openalice-runner serve` defaults (embedded SmolLM2-135M-Instruct, bf16, CPU)",
    "",
    f"Each row: `openalice-runner loadtest` for {levels and json.loads((work / f'c{levels[0]}.json').read_text())['duration_s']:g} s, "
    "half the requests streamed, max_tokens 32, six short chat prompts; latency and TTFT in ms (p50 / p95 / p99). "
    "Row `deep-tools` (the memory check): concurrency 4, four ~3.5k-token prompts with deeply nested tool "
    "schemas, max_tokens 4000. Rows `deep-schema` and `large-grammar` (memory checks too): concurrency 4, "
    "schemas nested 30 objects deep; eight distinct large response formats in turn (openalice_runner/bench/schema_workloads.py).",
    "",
    "| concurrency | s | sent | ok | 429 | failed | 5xx | latency ms | TTFT ms | req/s | tokens/s |",
    "|---|---|---|---|---|---|---|---|---|---|---|",
    *rows,
    "",
    *(["The probe's requests, after the rows (`openalice_runner/bench/probe_requests.py`):", *probe_lines, ""]
      if probe else []),
    f"Server peak RSS (VmHWM): {peak / 2**20:.0f} MiB ({peak / 2**30:.2f} GiB; the bound is {RSS_BOUND / 2**30:g} GiB: "
    f"{'within' if peak <= RSS_BOUND else 'OVER'}). "
    f"5xx answered by the server over the whole run (/metrics): {fivexx:.0f}. Exit code after SIGTERM: {exit_code}.",
    "",
])
out.write_text(text)
print(text)
sys.exit(0 if peak <= RSS_BOUND and not probe_failed else 1)  # the memory check (and a probe answered 5xx) fail the script
EOF
