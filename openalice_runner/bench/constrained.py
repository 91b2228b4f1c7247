"""`openalice-runner bench-constrained`: grammar-constrained turns, with and without forced drafts.

For the workload's tool-call cases (tool_choice "required": the reply is one or more calls) and a
structured-output variant of its summarize and rag cases (a JSON schema the reply must follow),
four modes run side by side on one engine, in turns per case:
- `unconstrained-off`: no grammar, no speculation (the reply may or may not parse);
- `constrained-off`: the grammar's mask, every token its own pass;
- `constrained-forced`: forced tokens drafted for free (always accepted);
- `constrained-forced-ngram`: forced tokens first, then n-gram drafts.
Greedy: the three constrained modes must emit the same tokens. Reported per case and mode:
tokens/s, tokens per target pass, grammar mask time per token, whether the reply parses.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace

from openalice_runner.bench.runner import geomean
from openalice_runner.bench.workload import Case, render_case
from openalice_runner.engine import Engine, SamplingParams, SpecConfig
from openalice_runner.engine.grammar import json_grammar, tool_call_grammar

MODES = ("unconstrained-off", "constrained-off", "constrained-forced", "constrained-forced-ngram")
STRUCTURED_TYPES = ("summarize", "rag")

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


def constrained_cases(cases: list[Case]) -> list[tuple[Case, str]]:
    """(case, grammar text) for the tool-call cases and the structured variants of summarize/rag."""
    out = []
    for case in cases:
        if case.turn_type == "tool_call" and case.tools:
            out.append((case, tool_call_grammar(case.tools, "required")))
        elif case.turn_type in STRUCTURED_TYPES:
            schema = SCHEMAS[case.turn_type]
            ask = (f"\n\nReply with one JSON object only, with the keys {', '.join(schema['properties'])}: "
                   f"{json.dumps(schema)}")
            messages = [dict(m) for m in case.messages]
            last = max(i for i, m in enumerate(messages) if m["role"] == "user")
            messages[last]["content"] = messages[last]["content"] + ask
            out.append((replace(case, id=f"{case.id}-json", messages=messages,
                                extra={**case.extra, "schema": schema}), json_grammar(schema)))
    return out


def render(engine: Engine, case: Case) -> list[int]:
    if case.tools:  # the tools block, as every tool_choice renders it (the provider's prefill is
        # left out: every mode's reply starts at the grammar's start)
        from openalice_runner.providers import tool_format

        return engine.render_chat(tool_format.render_fallback_messages(case.messages, case.tools, "required"))
    return render_case(engine, case)


def parses(case: Case, text: str) -> bool:
    """Whether the reply is in the requested shape: valid calls of offered tools, or JSON of the schema."""
    if case.tools:
        from openalice_runner.providers.tool_format import parse_tool_calls

        names = {t["function"]["name"] for t in case.tools}
        parsed = parse_tool_calls(text, names)
        return bool(parsed.tool_calls) and not parsed.malformed and not (parsed.content or "").strip()
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), case.extra["schema"])
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def spec_for(mode: str, gamma: int) -> SpecConfig:
    if mode == "constrained-forced-ngram":
        return SpecConfig(method="ngram", gamma=gamma)
    return SpecConfig(method="off", forced_drafts=mode != "constrained-off")


def bench_constrained(engine: Engine, cases: list[Case], gamma: int = 5, repeat: int = 1,
                      progress: Callable[[str], None] | None = None) -> dict:
    rows = []
    for case, text in constrained_cases(cases):
        grammar = engine.grammars.compile(text)
        prompt = render(engine, case)
        sampling = SamplingParams(max_tokens=case.max_tokens)
        runs: dict[str, list] = {m: [] for m in MODES}
        for _ in range(repeat):
            for mode in MODES:  # in turns: a noisy minute hits every mode alike
                use = None if mode == "unconstrained-off" else grammar
                runs[mode].append(engine.generate(prompt, sampling, spec_for(mode, gamma), grammar=use))
        best = {m: min(rs, key=lambda r: r.stats.total_s) for m, rs in runs.items()}
        row = {"case": case.id, "turn_type": case.turn_type, "modes": {}}
        for mode, result in best.items():
            s = result.stats
            decode_s = max(s.total_s - s.ttft_s, 1e-9)
            row["modes"][mode] = {
                "completion_tokens": s.completion_tokens,
                "tokens_per_s": round(s.completion_tokens / s.total_s, 2) if s.total_s else 0.0,
                "tokens_per_pass": round(s.mean_tokens_per_pass, 3),
                "step_ms": round(1000 * decode_s / max(s.target_passes, 1), 3),
                "mask_ms_per_token": round(1000 * s.mask_s / max(s.completion_tokens, 1), 4),
                "mask_ms_per_pass": round(1000 * s.mask_s / max(s.target_passes + 1, 1), 4),
                "forced": s.forced_tokens,
                "parses": parses(case, result.text),
                "finish_reason": s.finish_reason,
            }
        constrained = [best[m].token_ids for m in MODES[1:]]
        row["constrained_identical"] = all(ids == constrained[0] for ids in constrained)
        rows.append(row)
        if progress:
            progress(_row_line(row))
    return {"gamma": gamma, "runs": rows, "summary": summarize(rows)}


def summarize(rows: list[dict]) -> dict:
    def ratio(a: str, b: str, turn_types: tuple[str, ...]) -> float | None:
        return geomean([r["modes"][a]["tokens_per_s"] / r["modes"][b]["tokens_per_s"]
                        for r in rows if r["turn_type"] in turn_types and r["modes"][b]["tokens_per_s"]])

    plain_step = [r["modes"]["unconstrained-off"]["step_ms"] for r in rows]
    mask_pass = [r["modes"]["constrained-off"]["mask_ms_per_pass"] for r in rows]
    return {
        "forced_ngram_vs_constrained_off_tool_call": ratio("constrained-forced-ngram", "constrained-off", ("tool_call",)),
        "forced_vs_constrained_off_tool_call": ratio("constrained-forced", "constrained-off", ("tool_call",)),
        "forced_ngram_vs_constrained_off_structured": ratio("constrained-forced-ngram", "constrained-off",
                                                             STRUCTURED_TYPES),
        "mask_share_of_plain_step": round(sum(mask_pass) / sum(plain_step), 4) if sum(plain_step) else None,
        "parse": {m: f"{sum(r['modes'][m]['parses'] for r in rows)}/{len(rows)}" for m in MODES},
        "constrained_identical": f"{sum(r['constrained_identical'] for r in rows)}/{len(rows)}",
    }


def _row_line(row: dict) -> str:
    parts = [f"{row['case']:<24}"]
    for mode in MODES:
        m = row["modes"][mode]
        parts.append(f"{mode} {m['tokens_per_s']:.1f} tok/s {m['tokens_per_pass']:.2f}/pass "
                     f"{'ok' if m['parses'] else 'BAD'}")
    return "  ".join(parts)


def format_table(report: dict) -> str:
    lines = ["| case | mode | tokens | tok/s | tokens/pass | forced | mask ms/token | step ms | parses |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in report["runs"]:
        for mode in MODES:
            m = r["modes"][mode]
            lines.append(f"| {r['case']} | {mode} | {m['completion_tokens']} | {m['tokens_per_s']:.1f} | "
                         f"{m['tokens_per_pass']:.2f} | {m['forced']} | {m['mask_ms_per_token']:.3f} | "
                         f"{m['step_ms']:.1f} | {'yes' if m['parses'] else 'no'} |")
    s = report["summary"]
    lines += [
        "",
        f"- tool-call turns, tokens/s geomean: constrained+forced+ngram / constrained off = "
        f"{s['forced_ngram_vs_constrained_off_tool_call']}×; constrained+forced / constrained off = "
        f"{s['forced_vs_constrained_off_tool_call']}×",
        f"- structured summarize/rag: constrained+forced+ngram / constrained off = "
        f"{s['forced_ngram_vs_constrained_off_structured']}×",
        f"- mask time per pass (constrained off) / plain decode step (unconstrained off): "
        f"{s['mask_share_of_plain_step']}",
        f"- replies that parse: {s['parse']}; constrained modes identical: {s['constrained_identical']}",
    ]
    return "\n".join(lines)
