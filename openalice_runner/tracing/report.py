"""Summaries of a JSON-lines trace file: where an agent's time goes, per turn type and step position."""

from __future__ import annotations

import statistics
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from openalice_runner.tracing import attributes as A

_NS_PER_MS = 1_000_000


def _op(span: dict[str, Any]) -> str | None:
    return span.get("attributes", {}).get(A.GEN_AI_OPERATION_NAME)


def duration_ms(span: dict[str, Any]) -> float:
    return (span["end_ns"] - span["start_ns"]) / _NS_PER_MS


def _percentile_of_some(values: list[float], q: float) -> float:
    """`percentile` of a list known to hold values (a turn type's latencies: one per turn seen)."""
    value = percentile(values, q)
    assert value is not None
    return value


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 100]); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))  # ceil(n*q/100), at least 1
    return ordered[int(rank) - 1]


@dataclass
class StepRow:
    turn_type: str
    step: int | None
    kind: str  # "chat" or "tool"
    count: int = 0
    latency_ms: list[float] = field(default_factory=list)
    ttft_ms: list[float] = field(default_factory=list)
    tokens_per_s: list[float] = field(default_factory=list)
    proposed: int = 0
    accepted: int = 0
    gammas: list[int] = field(default_factory=list)
    methods: Counter = field(default_factory=Counter)
    errors: int = 0
    tools: Counter = field(default_factory=Counter)

    def add(self, span: dict[str, Any]) -> None:
        attrs = span.get("attributes", {})
        self.count += 1
        self.latency_ms.append(duration_ms(span))
        if span.get("status", {}).get("code") == "ERROR":
            self.errors += 1
        if self.kind == "tool":
            self.tools[attrs.get(A.GEN_AI_TOOL_NAME, "?")] += 1
            return
        if (ttft := attrs.get(A.LATENCY_TTFT_MS)) is not None:
            self.ttft_ms.append(float(ttft))
        tps = attrs.get(A.TOKENS_PER_SECOND)
        if tps is None and attrs.get(A.GEN_AI_USAGE_OUTPUT_TOKENS) and self.latency_ms[-1] > 0:
            tps = attrs[A.GEN_AI_USAGE_OUTPUT_TOKENS] / (self.latency_ms[-1] / 1000.0)
        if tps is not None:
            self.tokens_per_s.append(float(tps))
        self.proposed += int(attrs.get(A.SPEC_PROPOSED) or 0)
        self.accepted += int(attrs.get(A.SPEC_ACCEPTED) or 0)
        if (gamma := attrs.get(A.SPEC_GAMMA)) is not None:
            self.gammas.append(int(gamma))
        self.methods[attrs.get(A.SPEC_METHOD, "off")] += 1

    def to_dict(self) -> dict[str, Any]:
        def p(values: list[float], q: float) -> float | None:
            v = percentile(values, q)
            return None if v is None else round(v, 3)

        return {
            "turn_type": self.turn_type,
            "step": self.step,
            "kind": self.kind,
            "count": self.count,
            "errors": self.errors,
            "latency_ms_p50": p(self.latency_ms, 50),
            "latency_ms_p95": p(self.latency_ms, 95),
            "ttft_ms_p50": p(self.ttft_ms, 50),
            "ttft_ms_p95": p(self.ttft_ms, 95),
            "tokens_per_s_p50": p(self.tokens_per_s, 50),
            "acceptance_rate": round(self.accepted / self.proposed, 4) if self.proposed else None,
            "gamma_mean": round(statistics.fmean(self.gammas), 2) if self.gammas else None,
            "method": self.methods.most_common(1)[0][0] if self.methods else None,
            "tools": dict(self.tools) if self.tools else None,
        }


def _turn_of(span: dict[str, Any], by_id: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """The nearest invoke_agent ancestor of a span in the same file."""
    parent_id = span.get("parent_id")
    seen = 0
    while parent_id and seen < 64:
        parent = by_id.get(parent_id)
        if parent is None:
            return None
        if _op(parent) == A.OP_INVOKE_AGENT:
            return parent
        parent_id = parent.get("parent_id")
        seen += 1
    return None


def build_report(spans: Iterable[dict[str, Any]]) -> dict[str, Any]:
    spans = list(spans)
    by_id = {s["span_id"]: s for s in spans}
    rows: dict[tuple[str, int | None, str], StepRow] = {}
    turns: dict[str, list[float]] = defaultdict(list)
    turn_steps: dict[str, list[int]] = defaultdict(list)
    children: Counter = Counter()
    for span in spans:
        op = _op(span)
        attrs = span.get("attributes", {})
        if op == A.OP_INVOKE_AGENT:
            turn_type = attrs.get(A.TURN_TYPE, "-")
            turns[turn_type].append(duration_ms(span))
            continue
        if op not in (A.OP_CHAT, A.OP_EXECUTE_TOOL):
            continue
        turn = _turn_of(span, by_id)
        if turn is not None:
            children[turn["span_id"]] += 1
        turn_type = attrs.get(A.TURN_TYPE) or (turn or {}).get("attributes", {}).get(A.TURN_TYPE) or "-"
        step = attrs.get(A.STEP)
        kind = "chat" if op == A.OP_CHAT else "tool"
        key = (turn_type, step, kind)
        row = rows.get(key)
        if row is None:
            row = rows[key] = StepRow(turn_type, step, kind)
        row.add(span)
    for span in spans:
        if _op(span) == A.OP_INVOKE_AGENT:
            turn_type = span.get("attributes", {}).get(A.TURN_TYPE, "-")
            turn_steps[turn_type].append(children[span["span_id"]])

    def sort_key(key: tuple[str, int | None, str]) -> tuple:
        turn_type, step, kind = key
        return (turn_type, -1 if step is None else step, kind)

    return {
        "spans": len(spans),
        "turns": [
            {
                "turn_type": turn_type,
                "count": len(values),
                "latency_ms_p50": round(_percentile_of_some(values, 50), 3),
                "latency_ms_p95": round(_percentile_of_some(values, 95), 3),
                "steps_mean": round(statistics.fmean(turn_steps[turn_type]), 2)
                if turn_steps[turn_type]
                else 0,
            }
            for turn_type, values in sorted(turns.items())
        ],
        "steps": [rows[key].to_dict() for key in sorted(rows, key=sort_key)],
    }


def _fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def format_report(report: dict[str, Any]) -> str:
    lines = [f"{report['spans']} spans"]
    if report["turns"]:
        lines += ["", "turns", f"{'turn type':<14}{'count':>6}{'p50 ms':>10}{'p95 ms':>10}{'steps':>7}"]
        for t in report["turns"]:
            lines.append(
                f"{t['turn_type']:<14}{t['count']:>6}{_fmt(t['latency_ms_p50']):>10}"
                f"{_fmt(t['latency_ms_p95']):>10}{_fmt(t['steps_mean']):>7}"
            )
    header = (
        f"{'turn type':<14}{'step':>5} {'kind':<5}{'count':>6}{'p50 ms':>10}{'p95 ms':>10}"
        f"{'ttft p50':>10}{'tok/s p50':>10}{'accept':>8}{'gamma':>7}  method/tools"
    )
    lines += ["", "steps", header]
    for r in report["steps"]:
        what = r["method"] or ""
        if r["tools"]:
            what = ",".join(f"{name}x{n}" for name, n in r["tools"].items())
        lines.append(
            f"{r['turn_type']:<14}{_fmt(r['step']):>5} {r['kind']:<5}{r['count']:>6}"
            f"{_fmt(r['latency_ms_p50']):>10}{_fmt(r['latency_ms_p95']):>10}{_fmt(r['ttft_ms_p50']):>10}"
            f"{_fmt(r['tokens_per_s_p50']):>10}{_fmt(r['acceptance_rate'], 2):>8}{_fmt(r['gamma_mean']):>7}  {what}"
        )
    return "\n".join(lines)
