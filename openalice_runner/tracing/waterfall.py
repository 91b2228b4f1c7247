"""One turn's waterfall as a PNG: its model calls and tool calls on a time line (matplotlib, Agg)."""

from __future__ import annotations

from typing import Any

from openalice_runner.tracing import attributes as A
from openalice_runner.tracing.report import _op, duration_ms

_COLORS = {"chat": "#4C72B0", "ttft": "#1F3E73", "tool": "#DD8452", "turn": "#BBBBBB", "error": "#C44E52"}


def _descendants(turn: dict[str, Any], spans: list[dict[str, Any]]) -> list[dict[str, Any]]:
    children: dict[str, list[dict[str, Any]]] = {}
    for s in spans:
        if s.get("parent_id"):
            children.setdefault(s["parent_id"], []).append(s)
    out, stack = [], [turn["span_id"]]
    while stack:
        for child in children.get(stack.pop(), []):
            out.append(child)
            stack.append(child["span_id"])
    return out


def select_turn(spans: list[dict[str, Any]], turn_id: str | None = None) -> tuple[dict[str, Any], list[dict]]:
    """The turn to draw: the one whose span or trace id is `turn_id`, else the one with the most steps
    (the latest among equals)."""
    turns = [s for s in spans if _op(s) == A.OP_INVOKE_AGENT]
    if turn_id:
        turns = [t for t in turns if turn_id in (t["span_id"], t["trace_id"])]
        if not turns:
            raise ValueError(f"no invoke_agent span with span or trace id {turn_id!r}")
    if not turns:
        raise ValueError("the trace holds no invoke_agent (turn) span")
    scored = [(len(_descendants(t, spans)), t["start_ns"], t) for t in turns]
    _, _, turn = max(scored, key=lambda x: (x[0], x[1]))
    steps = [s for s in _descendants(turn, spans) if _op(s) in (A.OP_CHAT, A.OP_EXECUTE_TOOL)]
    return turn, sorted(steps, key=lambda s: s["start_ns"])


def _label(span: dict[str, Any]) -> str:
    attrs = span.get("attributes", {})
    step = attrs.get(A.STEP)
    prefix = f"#{step} " if step is not None else ""
    return prefix + span["name"]


def _annotation(span: dict[str, Any]) -> str:
    attrs = span.get("attributes", {})
    parts = [f"{duration_ms(span):.0f} ms"]
    if _op(span) == A.OP_CHAT:
        if (out := attrs.get(A.GEN_AI_USAGE_OUTPUT_TOKENS)) is not None:
            parts.append(f"{out} tok")
        method = attrs.get(A.SPEC_METHOD)
        if method and method != "off":
            rate = attrs.get(A.SPEC_ACCEPTANCE_RATE)
            parts.append(
                f"{method} γ={attrs.get(A.SPEC_GAMMA)}" + (f" α={rate:.2f}" if rate is not None else "")
            )
    if span.get("status", {}).get("code") == "ERROR":
        parts.append(str(attrs.get(A.ERROR_TYPE, "error")))
    return ", ".join(parts)


def plot_turn(spans: list[dict[str, Any]], out_path: str, turn_id: str | None = None) -> dict[str, Any]:
    """Draw one turn; returns {"turn": span id, "trace_id", "steps": n} for the caller to report."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    turn, steps = select_turn(spans, turn_id)
    t0 = turn["start_ns"]
    rows = [turn, *steps]
    height = 1.6 + 0.45 * len(rows)
    fig, ax = plt.subplots(figsize=(11, height), dpi=110)
    turn_ms = duration_ms(turn)
    for y, span in enumerate(rows):
        start = (span["start_ns"] - t0) / 1e6
        width = max(duration_ms(span), turn_ms * 0.002)
        op = _op(span)
        error = span.get("status", {}).get("code") == "ERROR"
        if op == A.OP_INVOKE_AGENT:
            color = _COLORS["turn"]
        elif op == A.OP_EXECUTE_TOOL:
            color = _COLORS["tool"]
        else:
            color = _COLORS["chat"]
        ax.barh(y, width, left=start, height=0.6, color=_COLORS["error"] if error else color)
        ttft = span.get("attributes", {}).get(A.LATENCY_TTFT_MS)
        if op == A.OP_CHAT and ttft and not error:
            ax.barh(y, min(float(ttft), width), left=start, height=0.6, color=_COLORS["ttft"])
        ax.text(start + width + turn_ms * 0.01, y, _annotation(span), va="center", fontsize=8)
    ax.set_yticks(range(len(rows)), [_label(s) for s in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("time since turn start (ms)")
    ax.set_xlim(0, turn_ms * 1.35)
    attrs = turn.get("attributes", {})
    title = f"{turn['name']}  ·  turn type {attrs.get(A.TURN_TYPE, '-')}  ·  {turn_ms:.0f} ms"
    if conv := attrs.get(A.GEN_AI_CONVERSATION_ID):
        title += f"  ·  conversation {conv}"
    ax.set_title(title, fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    fig.legend(
        handles=[
            Patch(color=_COLORS["ttft"], label="model call: time to first token"),
            Patch(color=_COLORS["chat"], label="model call: decode"),
            Patch(color=_COLORS["tool"], label="tool call"),
            Patch(color=_COLORS["error"], label="error"),
        ],
        loc="lower center",
        ncol=4,
        fontsize=7,
        frameon=False,
    )
    fig.tight_layout(rect=(0, 0.35 / height, 1, 1))
    fig.savefig(out_path)
    plt.close(fig)
    return {"turn": turn["span_id"], "trace_id": turn["trace_id"], "steps": len(steps), "plot": out_path}
