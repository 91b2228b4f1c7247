"""What each release mode costs: the agent loops through one `serve` per mode (the default policy,
turn types stated), side by side, round-robin (`bench-loops`'s driver and report). The report's
`speedup["pass/MODE"]` is MODE's wall time over pass's (above 1: the mode is slower), with each
target's time to first token and ms per token."""

from __future__ import annotations

from typing import Any

from openalice_runner.bench.side_channel.fingerprint import MODES


def run(workload: str, modes: tuple[str, ...] = MODES, repeat: int = 3, warmup: int = 1,
        providers: str | None = None, conversations: list[str] | None = None, log=print) -> dict[str, Any]:
    from openalice_runner.bench.loop_targets import Servers, TargetSpec
    from openalice_runner.bench.loops import bench_loops, load_loops

    loops = load_loops(workload, conversations)
    with Servers(providers=providers, log=log) as servers:
        targets = [servers.start(TargetSpec(mode, sidecar="policy", args=["--stream-release", mode]))
                   for mode in modes]
        return bench_loops(loops, targets, repeat=repeat, warmup=warmup, progress=log)


def format_table(report: dict[str, Any]) -> str:
    s = report["summary"]
    lines = [f"kept: {report['kept']}", "",
             "| mode | total s | TTFT p50 first s | TTFT p50 later s | ms per token | wall time over pass (all / copy-heavy / chat) |",
             "|---|---|---|---|---|---|"]
    names = list(s["targets"])
    for name in names:
        t = s["targets"][name]
        ratio = s["speedup"].get(f"{names[0]}/{name}")
        over = "-" if ratio is None else f"{ratio['all']} / {ratio['copy_heavy']} / {ratio['chat']}"
        lines.append(f"| {name} | {t['seconds_total']} | {t['ttft_p50_first_s']} | {t['ttft_p50_later_s']} | "
                     f"{t['ms_per_token']} | {over} |")
    lines += ["", f"outputs: {s['outputs']}"]
    return "\n".join(lines)
