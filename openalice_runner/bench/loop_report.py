"""`bench-loops`' report for people: a progress line per run, the Markdown tables, the plot."""

from __future__ import annotations

from openalice_runner.bench.loop_first_token import _first_token_table


def _run_line(run: dict) -> str:
    calls = run["calls"]
    ttfts = " ".join(f"{c.ttft_s:.2f}" for c in calls)
    tokens = sum(c.completion_tokens or 0 for c in calls)
    cached = "/".join(str(c.cached_tokens) for c in calls)
    return (f"run {run['run'] + 1} {run['id']:<16} {run['target']:<18} {run['seconds']:7.2f} s  "
            f"{tokens:>4} tokens  ttft {ttfts}  cached {cached}")


def format_table(report: dict) -> str:
    summary = report["summary"]
    targets = list(summary["targets"])
    ids = list(dict.fromkeys(r["id"] for r in report["conversations"]))
    by = {(r["id"], r["target"]): r for r in report["conversations"]}
    kinds = {r["id"]: r["kind"] for r in report["conversations"]}
    lines = [f"rows: {report['kept']} (conversation wall time)"] if report.get("kept") else []
    lines += ["| conversation | kind | " + " | ".join(f"{t} s" for t in targets) + " |",
              "|---|---|" + "---|" * len(targets)]
    for i in ids:
        lines.append(f"| {i} | {kinds[i]} | " + " | ".join(f"{by[i, t]['seconds']:.2f}" if (i, t) in by else "-" for t in targets) + " |")
    lines += ["", "| target | total s | TTFT p50 first s | TTFT p50 later s | later/first | tokens | ms/token | cached |",
              "|---|---|---|---|---|---|---|---|"]
    for t, s in summary["targets"].items():
        lines.append(f"| {t} | {s['seconds_total']} | {s['ttft_p50_first_s']} | {s['ttft_p50_later_s']} | "
                     f"{s['ttft_later_over_first']} | {s['completion_tokens']} | {s['ms_per_token']} | {s['cached_tokens']} |")
    lines += ["", "| speedup (geomean of conversation wall time) | all | copy-heavy | chat |", "|---|---|---|---|"]
    for pair, r in summary["speedup"].items():
        lines.append(f"| {pair} | {r['all']} | {r['copy_heavy']} | {r['chat']} |")
    if summary.get("inferred_over_stated"):
        lines += ["", "| inferred over stated turn types (speedup of the -inferred twins / the pair's) | all | "
                  "copy-heavy | chat |", "|---|---|---|---|"]
        lines += [f"| {pair} | {r['all']} | {r['copy_heavy']} | {r['chat']} |"
                  for pair, r in summary["inferred_over_stated"].items()]
    lines += ["", "| speedup per token (wall time per completion token) | all |", "|---|---|"]
    lines += [f"| {pair} | {r} |" for pair, r in summary["speedup_per_token"].items()]
    if summary.get("paired_calls"):
        lines += ["", "| per call, paired (same call, same repeat, same output) | calls | TTFT p50 ms | time p50 ms |",
                  "|---|---|---|---|"]
        lines += [f"| {pair} | {r['calls_paired']} | {r['ttft_p50_ms']} | {r['seconds_p50_ms']} |"
                  for pair, r in summary["paired_calls"].items()]
    lines += _first_token_table(summary.get("first_token") or {})
    for name, o in summary.get("outputs", {}).items():
        lines.append(f"\n- {name}: outputs identical to off in {o['identical_to_off']} calls"
                     + ("" if not o["mismatches"] else f"; mismatches: {o['mismatches'][:8]}"))
    return "\n".join(lines)


def plot(report: dict, path: str) -> None:
    """Per call: total time (bars) and TTFT (dots), one group per conversation, one colour per target."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    targets = list(report["summary"]["targets"])
    ids = list(dict.fromkeys(r["id"] for r in report["conversations"]))
    by = {(r["id"], r["target"]): r for r in report["conversations"]}
    fig, ax = plt.subplots(figsize=(max(8, 1.6 * len(ids) * len(targets)), 5))
    width = 0.8 / len(targets)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    x = 0.0
    ticks, labels = [], []
    for i in ids:
        calls = max(len(by[i, t]["calls"]) for t in targets if (i, t) in by)
        for k in range(calls):
            for j, t in enumerate(targets):
                row = by.get((i, t))
                if row is None or k >= len(row["calls"]):
                    continue
                c = row["calls"][k]
                colour = colours[j % len(colours)]
                ax.bar(x + j * width, c["seconds"], width, color=colour, alpha=0.6,
                       label=t if (i, k) == (ids[0], 0) else None)
                ax.plot(x + j * width, c["ttft_s"], "k.", markersize=4)
            ticks.append(x + 0.4 - width / 2)
            labels.append(f"{i.removeprefix('loop-')}#{k + 1}")
            x += 1
        x += 0.5
    ax.set_xticks(ticks, labels, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("seconds per call (bar: total, dot: time to first token)")
    ax.set_title("agent loops: per-call latency")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
