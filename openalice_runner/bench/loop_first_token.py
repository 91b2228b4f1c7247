"""`bench-loops`' time before the first token by part (issue 49): the parts of each call's
`speculation.first_token` (first_token.py) summed per target, first calls and later ones apart,
and their table."""

from __future__ import annotations

from typing import Any

from openalice_runner.first_token import PARTS

RATES = ("new_tokens_per_s", "unheld_tokens_per_s", "prefill_tokens_per_s")


def first_token_summary(rows: list[dict], targets: list[str], long: dict[str, list[dict]] | None = None
                        ) -> dict[str, Any]:
    """Per target, the first calls of conversations and the later ones apart: their time to the first
    token, its parts' sums (where the server reports `speculation.first_token`), the rest (what no part
    covers: HTTP, the policy, thread hops, the scheduler's own work), the prompt tokens not served from
    the cache, and those tokens' rate (tokens per second, RATES) over the whole time to the first
    token, over that time less the part held back (a tool stream's first text waiting on the decode
    rounds of its call's name: the reply's time, not the prompt's) and over the prefill's passes
    alone. `long`: each target's long-prompt calls of the same run (loop_long_prompt.py), summed as
    a group of their own, and the later calls' rates over theirs."""
    out: dict[str, Any] = {}
    for name in targets:
        mine = [r for r in rows if r["target"] == name]
        groups = {"first": [r["calls"][0] for r in mine if r["calls"]],
                  "later": [c for r in mine for c in r["calls"][1:]]}
        if long is not None:
            groups["long"] = long.get(name, [])
        out[name] = {group: _first_token_sums(calls) for group, calls in groups.items()}
        if long is not None:
            out[name]["later_over_long"] = {
                rate: _ratio(out[name]["later"][rate], out[name]["long"][rate])
                for rate in RATES}
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def _first_token_sums(calls: list[dict]) -> dict[str, Any]:
    ttft_ms = sum(1000 * c["ttft_s"] for c in calls)
    new_tokens = sum((c["prompt_tokens"] or 0) - (c["cached_tokens"] or 0) for c in calls)
    parts: dict[str, float] = {}
    prefill_tokens = reported = 0
    for call in calls:
        breakdown = (call.get("speculation") or {}).get("first_token")
        if not breakdown:
            continue
        reported += 1
        for part, ms in breakdown["parts_ms"].items():
            parts[part] = parts.get(part, 0.0) + ms
        prefill_tokens += sum(tokens for tokens, _ in breakdown["prefill_chunks"])
    covered = sum(parts.values())
    prefill_ms = parts.get("prefill", 0.0)
    unheld_ms = ttft_ms - parts.get("held_back", 0.0)
    return {
        "calls": len(calls),
        "reported": reported,
        "ttft_ms": round(ttft_ms, 1),
        "parts_ms": {part: round(ms, 1) for part, ms in parts.items()},
        "rest_ms": round(ttft_ms - covered, 1) if reported == len(calls) else None,
        "new_prompt_tokens": new_tokens,
        "new_tokens_per_s": round(1000 * new_tokens / ttft_ms, 1) if ttft_ms else None,
        "unheld_tokens_per_s": round(1000 * new_tokens / unheld_ms, 1) if unheld_ms > 0 else None,
        "prefill_tokens_per_s": round(1000 * prefill_tokens / prefill_ms, 1) if prefill_ms else None,
    }


def _first_token_table(summary: dict[str, Any]) -> list[str]:
    """The time before the first token by part, ms summed over calls, per target and group."""
    if not any(g.get("reported") for t in summary.values() for g in t.values()):
        return []
    lines = ["", "| time to first token, ms summed (calls) | ttft | " + " | ".join(PARTS)
             + " | rest | new tokens | tok/s | tok/s less held back | prefill tok/s |", "|---|" + "---|" * (len(PARTS) + 6)]
    for target, groups in summary.items():
        for group, g in groups.items():
            if group == "later_over_long":
                lines.append(f"| {target} later / long | | " + " | ".join("" for _ in PARTS)
                             + " | | | " + " | ".join(str(g[rate]) for rate in RATES) + " |")
                continue
            cells = [str(g["parts_ms"].get(p, "-")) for p in PARTS]
            lines.append(f"| {target} {group} ({g['calls']}) | {g['ttft_ms']} | " + " | ".join(cells)
                         + f" | {g['rest_ms']} | {g['new_prompt_tokens']} | " + " | ".join(str(g[rate]) for rate in RATES) + " |")
    return lines
