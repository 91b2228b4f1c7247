"""`openalice-runner bench-follow-up`: an agent loop's next call, with and without prefix reuse.

An agent loop sends the whole conversation again with every model call. For each workload case
the first call answers the case; the follow-up call sends the case, that answer and one more
user message. The follow-up runs with the engine's prefix reuse off and on, in turns (with
`repeat`, round-robin, the median kept), on one engine, so a noisy minute hits both alike.
Reported per case: prompt tokens, tokens found in the cache, time to first token and total time
of the follow-up, and whether both outputs are identical (they must be: greedy, and reuse is exact).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from openalice_runner.bench.repeats import kept_run
from openalice_runner.bench.runner import geomean
from openalice_runner.bench.workload import Case, render_case
from openalice_runner.engine import Engine, SamplingParams, SpecConfig

FOLLOW_UP = "Thanks. Now give me the key point of your answer in one sentence."
MODES = ("full", "reuse")


def follow_up_prompt(engine: Engine, case: Case, answer: str) -> list[int]:
    messages = [*case.messages, {"role": "assistant", "content": answer}, {"role": "user", "content": FOLLOW_UP}]
    return render_case(engine, replace(case, messages=messages))


def bench_follow_up(engine: Engine, cases: list[Case], max_tokens: int = 64, repeat: int = 1,
                    spec: SpecConfig | None = None, progress: Callable[[str], None] | None = None) -> dict:
    if engine.scheduler is None:
        raise ValueError("prefix reuse needs the batching engine (max_batch > 1)")
    spec = spec or SpecConfig()
    scheduler = engine.scheduler
    saved = scheduler.prefix_reuse
    rows = []
    try:
        for case in cases:
            first_prompt = render_case(engine, case)
            runs: dict[str, list] = {m: [] for m in MODES}
            for _ in range(repeat):
                for mode in MODES:
                    scheduler.prefix_reuse = mode == "reuse"
                    first = engine.generate(first_prompt, SamplingParams(max_tokens=case.max_tokens), spec)
                    prompt = follow_up_prompt(engine, case, first.text)
                    runs[mode].append(engine.generate(prompt, SamplingParams(max_tokens=max_tokens), spec))
            full, reuse = (_median(runs[m]) for m in MODES)
            row = {
                "case": case.id,
                "turn_type": case.turn_type,
                "prompt_tokens": full.stats.prompt_tokens,
                "cached_tokens": reuse.stats.cached_prompt_tokens,
                "ttft_s": {m: round(r.stats.ttft_s, 4) for m, r in zip(MODES, (full, reuse), strict=True)},
                "total_s": {m: round(r.stats.total_s, 4) for m, r in zip(MODES, (full, reuse), strict=True)},
                "completion_tokens": full.stats.completion_tokens,
                "identical": full.token_ids == reuse.token_ids,
            }
            rows.append(row)
            if progress:
                progress(_row_line(row))
    finally:
        scheduler.prefix_reuse = saved
    return {"runs": rows, "summary": summarize(rows)}


def _median(results: list):
    return kept_run(results, seconds=lambda r: r.stats.total_s)


def summarize(rows: list[dict]) -> dict:
    return {
        "cases": len(rows),
        "prompt_tokens": sum(r["prompt_tokens"] for r in rows),
        "cached_tokens": sum(r["cached_tokens"] for r in rows),
        "ttft_speedup_geomean": geomean([r["ttft_s"]["full"] / r["ttft_s"]["reuse"] for r in rows]),
        "total_speedup_geomean": geomean([r["total_s"]["full"] / r["total_s"]["reuse"] for r in rows]),
        "total_s": {m: round(sum(r["total_s"][m] for r in rows), 2) for m in MODES},
        "identical": f"{sum(r['identical'] for r in rows)}/{len(rows)}",
    }


def _row_line(row: dict) -> str:
    t, total = row["ttft_s"], row["total_s"]
    return (f"{row['case']:<24} prompt {row['prompt_tokens']:>5}  cached {row['cached_tokens']:>5}  "
            f"ttft {t['full']:.2f}s -> {t['reuse']:.3f}s  total {total['full']:.2f}s -> {total['reuse']:.2f}s  "
            f"same={'yes' if row['identical'] else 'NO'}")


def format_table(report: dict) -> str:
    lines = ["| case | turn type | prompt tokens | cached | TTFT full → reuse (s) | total full → reuse (s) | same |",
             "|---|---|---|---|---|---|---|"]
    for r in report["runs"]:
        t, total = r["ttft_s"], r["total_s"]
        lines.append(f"| {r['case']} | {r['turn_type']} | {r['prompt_tokens']} | {r['cached_tokens']} | "
                     f"{t['full']:.2f} → {t['reuse']:.3f} ({t['full'] / t['reuse']:.1f}×) | "
                     f"{total['full']:.2f} → {total['reuse']:.2f} ({total['full'] / total['reuse']:.2f}×) | "
                     f"{'yes' if r['identical'] else 'NO'} |")
    s = report["summary"]
    lines.append("")
    lines.append(f"- cached {s['cached_tokens']} of {s['prompt_tokens']} follow-up prompt tokens; "
                 f"TTFT {s['ttft_speedup_geomean']}× and total {s['total_speedup_geomean']}× (geomeans); "
                 f"all follow-ups {s['total_s']['full']} s → {s['total_s']['reuse']} s; identical {s['identical']}")
    return "\n".join(lines)
