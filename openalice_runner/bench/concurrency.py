"""`openalice-runner bench-concurrency`: aggregate throughput and latency as concurrency grows.

For each concurrency C, C client threads send the workload's requests to one engine at once
(whole passes over the cases, as many as make at least 2·C requests), for each method:
- `off`, `ngram:G` (γ fixed at G), ...: the batched engine with that setting;
- `policy`: method per request and γ per step from the policy, with the live batch size;
- `serial-off`, `serial-ngram:G`: the same on an engine that runs one request at a time
  (`max_batch=1`, the decode loop before batching), for the comparison at concurrency 1.
Figures per (concurrency, method): aggregate tokens/s (all tokens over the wall time), p50 and
p95 request latency, p50 time to first token, mean tokens per target pass. All greedy. With
`repeat`, every (level, method) takes its turn in each round and each row is the run of median
throughput (odd counts) or the slower middle run (even counts: bench/repeats.py).
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from openalice_runner.bench.repeats import kept_label, kept_run
from openalice_runner.bench.runner import split_method
from openalice_runner.bench.workload import Case, render_case
from openalice_runner.engine import Engine, SamplingParams, SpecConfig
from openalice_runner.speculation import with_old_keys


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run_level(
    engine: Engine,
    serial: Engine | None,
    jobs: list[tuple[Case, list[int]]],
    concurrency: int,
    method: str,
    policy_store=None,
) -> dict:
    target = serial if method.startswith("serial-") else engine
    name = method.removeprefix("serial-")
    lock = threading.Lock()

    def one(job: tuple[Case, list[int]]):
        case, prompt = job
        sampling = SamplingParams(max_tokens=case.max_tokens)
        if name == "policy":
            from openalice_runner.policies import RequestContext

            running, waiting = target.scheduler.load if target.scheduler else (0, 0)
            decision = policy_store.decide(
                RequestContext(turn_type=case.turn_type, batch_size=running + waiting + 1, provider="local")
            )
            # the plan's γ by batch size is followed at every step (SpecConfig.per_batch)
            result = target.generate(prompt, sampling, SpecConfig.from_plan(decision))
            with lock:
                policy_store.observe(case.turn_type, decision.method, "local", result.stats.outcome())
            return result
        base, gamma = split_method(name, 5)
        return target.generate(prompt, sampling, SpecConfig(method=base, gamma=gamma))

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(one, jobs))
    wall = time.perf_counter() - start
    tokens = sum(r.stats.completion_tokens for r in results)
    latencies = [r.stats.total_s for r in results]
    ttfts = [r.stats.ttft_s for r in results]
    passes = sum(r.stats.target_passes for r in results)
    return with_old_keys("bench_concurrency", {
        "concurrency": concurrency,
        "method": method,
        "requests": len(results),
        "tokens": tokens,
        "seconds": round(wall, 3),
        "tokens_per_second": round(tokens / wall, 2),
        "latency_p50_s": round(statistics.median(latencies), 3),
        "latency_p95_s": round(_percentile(latencies, 0.95), 3),
        "ttft_p50_s": round(statistics.median(ttfts), 3),
        "tokens_per_pass": round(tokens / passes, 3) if passes else None,
        "token_ids": [r.token_ids for r in results],
    })


def bench_concurrency(
    engine: Engine,
    cases: list[Case],
    levels: list[int],
    methods: list[str],
    policy_store=None,
    serial: Engine | None = None,
    progress: Callable[[str], None] | None = None,
    repeat: int = 1,
) -> dict:
    """`repeat` > 1 goes round every (level, method) that many times, so a slow minute of a
    noisy machine hits methods and levels alike, and keeps for each the run of median
    throughput (the slower middle run for an even count). Progress lines come per run."""
    if "policy" in methods and policy_store is None:
        raise ValueError("method 'policy' needs --policy FILE")
    if any(m.startswith("serial-") for m in methods) and serial is None:
        raise ValueError("serial-* methods need the one-at-a-time engine")
    if engine.max_batch < max(levels):
        raise ValueError(f"--max-batch {engine.max_batch} is below the highest concurrency {max(levels)}")
    prompts = [(case, render_case(engine, case)) for case in cases]
    warm = engine.encode("Hello there, how are you?")
    for e in filter(None, (engine, serial)):
        e.generate(warm, SamplingParams(max_tokens=8), SpecConfig(method="ngram", gamma=3))
    plan = {
        # whole passes over the cases, at least 2·C requests: every level runs the same mix of
        # turns (a cut pass would weigh some cases twice and compare unlike workloads)
        level: (prompts * -(-2 * level // len(prompts)), [m for m in methods if level == 1 or not m.startswith("serial-")])
        for level in levels
    }
    runs: dict[tuple[int, str], list[dict]] = {(level, m): [] for level, (_, chosen) in plan.items() for m in chosen}
    for _ in range(repeat):
        for level, (jobs, chosen) in plan.items():
            for method in chosen:
                run = run_level(engine, serial, jobs, level, method, policy_store)
                runs[level, method].append(run)
                if progress:
                    progress(
                        f"c={level:<3} {method:<16} {run['tokens_per_second']:>8.1f} tok/s  "
                        f"p50 {run['latency_p50_s']:.2f} s  ttft {run['ttft_p50_s']:.2f} s  "
                        f"tok/pass {run['tokens_per_pass']}"
                    )
    rows = []
    for level, (_, chosen) in plan.items():
        reference = None
        for method in chosen:
            done = runs[level, method]
            row = kept_run(done, throughput=lambda r: r["tokens_per_second"])
            row["runs_tokens_per_second"] = [r["tokens_per_second"] for r in done]
            outputs = [r.pop("token_ids") for r in done]
            if method == "off":
                reference = outputs[0]
            row["identical_to_off"] = None if reference is None else all(ids == reference for ids in outputs)
            rows.append(row)
    return {"runs": rows, "kept": kept_label(repeat)}


def format_table(report: dict) -> str:
    lines = [f"rows: {report['kept']}"] if report.get("kept") else []
    lines += [
        "| concurrency | method | tok/s (aggregate) | p50 latency s | p95 latency s | p50 TTFT s | tok/pass |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in report["runs"]:
        lines.append(
            f"| {r['concurrency']} | {r['method']} | {r['tokens_per_second']:.1f} | {r['latency_p50_s']:.2f} "
            f"| {r['latency_p95_s']:.2f} | {r['ttft_p50_s']:.2f} | {r['tokens_per_pass']} |"
        )
    return "\n".join(lines)


def plot(reports: dict[str, dict], path: str) -> None:
    """Throughput and p50 latency against concurrency, one line per method, per workload subset."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(reports), 2, figsize=(11, 4 * len(reports)), squeeze=False)
    for row, (title, report) in enumerate(reports.items()):
        methods = list(dict.fromkeys(r["method"] for r in report["runs"]))
        for method in methods:
            runs = [r for r in report["runs"] if r["method"] == method]
            xs = [r["concurrency"] for r in runs]
            style = "o" if len(runs) == 1 else "o-"
            axes[row][0].plot(xs, [r["tokens_per_second"] for r in runs], style, label=method)
            axes[row][1].plot(xs, [r["latency_p50_s"] for r in runs], style, label=method)
        for col, label in enumerate(("aggregate tokens/s", "p50 request latency (s)")):
            ax = axes[row][col]
            ax.set_xscale("log", base=2)
            ax.set_xlabel("concurrent requests")
            ax.set_ylabel(label)
            ax.set_title(f"{title}: {label}")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
