"""`openalice-runner bench-constrained`: grammar-constrained turns, with and without forced drafts.

For the workload's tool-call cases and a structured-output variant of its summarize and rag
cases, four modes run side by side on one engine, in turns per case:
- `unconstrained-off`: no grammar, no speculation (the reply may or may not parse);
- `constrained-off`: the grammar's mask, every token its own pass;
- `constrained-forced`: forced tokens drafted for free (always accepted);
- `constrained-forced-ngram`: forced tokens first, then n-gram drafts.

Each case becomes the request a client would send, and the local provider turns it into the
prompt and grammar it serves (`EmbeddedProvider.build_prompt`): a tool-call turn asks for one call
(`tool_choice: "required"`, `parallel_tool_calls: false`, as the workload's turns want one), so
a constrained reply is one valid call and then ends; a structured turn sends
`response_format: json_schema`. All four modes decode the same prompt (the provider's prefill
included); only the grammar and the speculation differ (and the provider's `</tool_call>` stop,
which unconstrained off keeps: there it is what ends a pre-filled call). Greedy: the three
constrained modes must emit the same tokens.

Reported per case and mode: tokens/s, tokens per target pass, grammar mask time per token,
whether the reply parses; in the summary, the ratios the issue sets targets for (constrained +
forced + ngram over constrained off, tokens/s: >= 1.3x on tool-call turns) and the mask time
per token against a plain decode step (<= 10%).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import jsonschema

from openalice_runner.bench.runner import geomean
from openalice_runner.bench.workload import Case
from openalice_runner.engine import Engine, SamplingParams, SpecConfig
from openalice_runner.providers.embedded.config import EmbeddedConfig
from openalice_runner.providers.embedded.tool_format import TOOL_CALL_CLOSE, parse_tool_calls
from openalice_runner.providers.local import EmbeddedProvider
from openalice_runner.types import ChatRequest

MODES = ("unconstrained-off", "constrained-off", "constrained-forced", "constrained-forced-ngram")
STRUCTURED_TYPES = ("summarize", "rag")
TARGET_SPEEDUP = 1.3  # constrained + forced + ngram over constrained off, tool-call turns (issue 22)
TARGET_MASK_SHARE = 0.10  # mask time per token over a plain decode step (issue 22)

# The structured-output variants: the instruction goes into the last user message (the same
# prompt in every mode), the schema into the grammar.
SCHEMAS = {
    "summarize": {
        "type": "object",
        "properties": {
            "summary": {"type": "string"},
            "public_functions": {"type": "array", "items": {"type": "string"}},
        },
        "required": ["summary", "public_functions"],
        "additionalProperties": False,
    },
    "rag": {
        "type": "object",
        "properties": {"answer": {"type": "string"}, "quote": {"type": "string"}},
        "required": ["answer", "quote"],
        "additionalProperties": False,
    },
}


def constrained_cases(cases: list[Case]) -> list[tuple[Case, ChatRequest]]:
    """(case, the request a client sends for it) for the tool-call cases (one call required) and
    the structured variants of summarize/rag (a JSON schema); other cases are left out."""
    out = []
    for case in cases:
        if case.turn_type == "tool_call" and case.tools:
            request = ChatRequest(messages=case.messages, tools=case.tools, tool_choice="required",
                                  parallel_tool_calls=False, max_tokens=case.max_tokens)
            out.append((case, request))
        elif case.turn_type in STRUCTURED_TYPES:
            schema = SCHEMAS[case.turn_type]
            ask = (f"\n\nReply with one JSON object only, with the keys {', '.join(schema['properties'])}: "
                   f"{json.dumps(schema)}")
            messages = [dict(m) for m in case.messages]
            last = max(i for i, m in enumerate(messages) if m["role"] == "user")
            messages[last]["content"] = messages[last]["content"] + ask
            structured = replace(case, id=f"{case.id}-json", messages=messages, extra={**case.extra, "schema": schema})
            request = ChatRequest(messages=messages, max_tokens=case.max_tokens, response_format={
                "type": "json_schema", "json_schema": {"name": case.turn_type, "schema": schema, "strict": True}})
            out.append((structured, request))
    return out


@dataclass
class Served:
    """What the local provider makes of a request: the prompt (its prefill included), the text
    the reply starts with, the grammar (None: free text) and the stop strings it adds."""

    ids: list[int]
    prefill: str
    grammar: Any
    stop: tuple[str, ...]  # what the provider adds: a pre-filled call stops at its close tag


def serve_prompt(engine: Engine, request: ChatRequest) -> Served:
    provider = EmbeddedProvider("bench", EmbeddedConfig(type="local", prefix_reuse=False), engine=engine)
    prompt = provider.build_prompt(request)
    # as the provider's sampling settings: a pre-filled call is one call, it stops at its close tag
    stop = (TOOL_CALL_CLOSE,) if prompt.prefill else ()
    return Served(prompt.ids, prompt.prefill, prompt.grammar, stop)


def parses(case: Case, text: str) -> bool:
    """Whether the reply (its prefill included) is in the requested shape: for a tool-call turn
    exactly one call (parallel_tool_calls is false) of an offered tool whose arguments match its
    schema, and nothing else; for a structured turn one JSON value of the schema."""
    if case.tools:
        schemas = {t["function"]["name"]: t["function"].get("parameters") or {} for t in case.tools}
        parsed = parse_tool_calls(text, set(schemas))
        if len(parsed.tool_calls) != 1 or parsed.malformed or (parsed.content or "").strip():
            return False
        call = parsed.tool_calls[0].function
        instance, schema = json.loads(call.arguments), schemas[call.name]
    else:
        try:
            instance = json.loads(text)
        except ValueError:
            return False
        schema = case.extra["schema"]
    try:
        jsonschema.validate(instance, schema)
    except jsonschema.ValidationError:
        return False
    return True


def spec_for(mode: str, gamma: int) -> SpecConfig:
    if mode == "constrained-forced-ngram":
        return SpecConfig(method="ngram", gamma=gamma)
    return SpecConfig(method="off", forced_drafts=mode != "constrained-off")


def bench_constrained(engine: Engine, cases: list[Case], gamma: int = 5, repeat: int = 1,
                      progress: Callable[[str], None] | None = None) -> dict:
    rows = []
    for case, request in constrained_cases(cases):
        served = serve_prompt(engine, request)
        # The provider's stop string only where no grammar ends the reply: with it, a pass that
        # accepts several tokens keeps fewer of them than one-token passes do for the same text
        # (stopping.py keeps the fewest tokens that reach the stop string), which would count the
        # same call as fewer tokens in the forced modes. The one-call grammar ends it anyway.
        free = SamplingParams(max_tokens=case.max_tokens, stop=served.stop)
        constrained = SamplingParams(max_tokens=case.max_tokens)
        runs: dict[str, list] = {m: [] for m in MODES}
        for _ in range(repeat):
            for mode in MODES:  # in turns: a noisy minute hits every mode alike
                if mode == "unconstrained-off":
                    runs[mode].append(engine.generate(served.ids, free, spec_for(mode, gamma)))
                else:
                    runs[mode].append(engine.generate(served.ids, constrained, spec_for(mode, gamma),
                                                      grammar=served.grammar))
        best = {m: min(rs, key=lambda r: r.stats.total_s) for m, rs in runs.items()}
        row = {"case": case.id, "turn_type": case.turn_type, "prefill": served.prefill, "modes": {}}
        for mode, result in best.items():
            row["modes"][mode] = mode_figures(result, served.prefill + result.text, case)
        same = [best[m].token_ids for m in MODES[1:]]
        row["constrained_identical"] = all(ids == same[0] for ids in same)
        rows.append(row)
        if progress:
            progress(_row_line(row))
    return {"gamma": gamma, "repeat": repeat, "runs": rows, "summary": summarize(rows)}


def mode_figures(result: Any, reply: str, case: Case) -> dict:
    """One mode's figures for one case. `decode_s` and `target_passes` are kept raw so the
    summary can pool them; a constrained reply computes one mask per emitted position (the
    prefill's token and one per pass) plus one per draft token it walks."""
    s = result.stats
    decode_s = max(s.total_s - s.ttft_s, 0.0)
    return {
        "completion_tokens": s.completion_tokens,
        "tokens_per_s": round(s.completion_tokens / s.total_s, 2) if s.total_s else 0.0,
        # after the first token: prefill (the same in every mode) left out of the comparison
        "decode_tokens_per_s": round((s.completion_tokens - 1) / decode_s, 2) if decode_s > 0 else 0.0,
        "tokens_per_pass": round(s.tokens_per_pass, 3),
        "target_passes": s.target_passes,
        "decode_s": round(decode_s, 6),
        "step_ms": round(1000 * decode_s / s.target_passes, 3) if s.target_passes else None,
        "mask_s": round(s.mask_s, 6),
        "mask_ms_per_token": round(1000 * s.mask_s / max(s.completion_tokens, 1), 4),
        "forced": s.forced,
        "parses": parses(case, reply),
        "finish_reason": s.finish_reason,
        "reply": reply,  # the prefill included
    }


def summarize(rows: list[dict]) -> dict:
    def ratio(a: str, b: str, turn_types: tuple[str, ...], figure: str = "tokens_per_s") -> float | None:
        return geomean([r["modes"][a][figure] / r["modes"][b][figure]
                        for r in rows if r["turn_type"] in turn_types and r["modes"][b][figure]])

    # Mask time per token: constrained off computes exactly one mask per emitted position (the
    # prefill's token, then one per pass), so its mask time over passes + 1 is the time of one
    # mask. A plain decode step: unconstrained off's decode time (after the first token) over
    # its passes. Both pooled over the cases (sums, then the ratio: long replies weigh more).
    plain = [r["modes"]["unconstrained-off"] for r in rows]
    masked = [r["modes"]["constrained-off"] for r in rows]
    passes = sum(m["target_passes"] for m in plain)
    plain_step_ms = 1000 * sum(m["decode_s"] for m in plain) / passes if passes else None
    masks = sum(m["target_passes"] + 1 for m in masked)
    mask_ms = 1000 * sum(m["mask_s"] for m in masked) / masks if masks else None
    share = mask_ms / plain_step_ms if mask_ms is not None and plain_step_ms else None
    parse = {}
    for mode in MODES:
        ok = sum(r["modes"][mode]["parses"] for r in rows)
        parse[mode] = {"parsed": ok, "replies": len(rows), "share": round(ok / len(rows), 3) if rows else None}
    return {
        "forced_ngram_vs_constrained_off_tool_call": ratio("constrained-forced-ngram", "constrained-off", ("tool_call",)),
        "forced_vs_constrained_off_tool_call": ratio("constrained-forced", "constrained-off", ("tool_call",)),
        "forced_ngram_vs_constrained_off_structured": ratio("constrained-forced-ngram", "constrained-off",
                                                             STRUCTURED_TYPES),
        "forced_vs_constrained_off_structured": ratio("constrained-forced", "constrained-off", STRUCTURED_TYPES),
        "decode_forced_ngram_vs_constrained_off_tool_call": ratio(
            "constrained-forced-ngram", "constrained-off", ("tool_call",), "decode_tokens_per_s"),
        "decode_forced_ngram_vs_constrained_off_structured": ratio(
            "constrained-forced-ngram", "constrained-off", STRUCTURED_TYPES, "decode_tokens_per_s"),
        "mask_ms_per_token": None if mask_ms is None else round(mask_ms, 4),
        "plain_step_ms": None if plain_step_ms is None else round(plain_step_ms, 3),
        "mask_share_of_plain_step": None if share is None else round(share, 4),
        "parse": parse,
        "constrained_identical": f"{sum(r['constrained_identical'] for r in rows)}/{len(rows)}",
    }


def _row_line(row: dict) -> str:
    parts = [f"{row['case']:<24}"]
    for mode in MODES:
        m = row["modes"][mode]
        parts.append(f"{mode} {m['tokens_per_s']:.1f} tok/s {m['tokens_per_pass']:.2f}/pass "
                     f"{'ok' if m['parses'] else 'BAD'}")
    return "  ".join(parts)


def _x(value: float | None, target: float | None = None) -> str:
    if value is None:
        return "n/a (no such cases)"
    return f"{value}×" + (f" (target ≥ {target}×: {'met' if value >= target else 'NOT met'})" if target else "")


def format_table(report: dict) -> str:
    lines = ["| case | mode | tokens | tok/s | decode tok/s | tokens/pass | forced | mask ms/token | step ms | finish "
             "| parses |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["runs"]:
        for mode in MODES:
            m = r["modes"][mode]
            step = "-" if m["step_ms"] is None else f"{m['step_ms']:.1f}"
            lines.append(f"| {r['case']} | {mode} | {m['completion_tokens']} | {m['tokens_per_s']:.1f} | "
                         f"{m['decode_tokens_per_s']:.1f} | {m['tokens_per_pass']:.2f} | {m['forced']} | {m['mask_ms_per_token']:.3f} | "
                         f"{step} | {m['finish_reason']} | {'yes' if m['parses'] else 'no'} |")
    s = report["summary"]
    share = s["mask_share_of_plain_step"]
    share_text = "n/a" if share is None else (
        f"{100 * share:.2f}% (target ≤ {100 * TARGET_MASK_SHARE:.0f}%: "
        f"{'met' if share <= TARGET_MASK_SHARE else 'NOT met'})")
    parse = ", ".join(f"{mode} {p['parsed']}/{p['replies']}" for mode, p in s["parse"].items())
    lines += [
        "",
        "- tool-call turns, tokens/s geomean: constrained+forced+ngram / constrained off = "
        f"{_x(s['forced_ngram_vs_constrained_off_tool_call'], TARGET_SPEEDUP)}; "
        f"constrained+forced / constrained off = {_x(s['forced_vs_constrained_off_tool_call'])}",
        "- structured summarize/rag turns, tokens/s geomean: constrained+forced+ngram / constrained off = "
        f"{_x(s['forced_ngram_vs_constrained_off_structured'])}; constrained+forced / constrained off = "
        f"{_x(s['forced_vs_constrained_off_structured'])}",
        "- decode tokens/s (after the first token), constrained+forced+ngram / constrained off: tool-call "
        f"{_x(s['decode_forced_ngram_vs_constrained_off_tool_call'])}; structured "
        f"{_x(s['decode_forced_ngram_vs_constrained_off_structured'])}",
        f"- mask time per token (constrained off): {s['mask_ms_per_token']} ms; plain decode step "
        f"(unconstrained off): {s['plain_step_ms']} ms; share: {share_text}",
        f"- replies that parse: {parse}; constrained modes identical: {s['constrained_identical']}",
    ]
    return "\n".join(lines)
