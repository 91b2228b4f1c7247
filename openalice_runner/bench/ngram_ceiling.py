"""The ceiling of prompt-lookup speculation on a workload, greedy, bf16.

Greedy output is fixed (it equals `off`'s), so the best any n-gram drafter can do is known:
replay `off`'s output and let the n-gram index propose with free verification (a pass of any
length costs one plain step) and no gate, for n_max in {4, 8} and γ in {7, 16, 64}, the best per
case. With the prefill and the plain step timed on the same engine, that gives the tokens per
second the ideal would reach, and its ratio to `off`.

    python -m openalice_runner.bench.ngram_ceiling --workload ../shared/workloads/agentic.jsonl [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import torch

from openalice_runner.bench.workload import load_workload, render_case
from openalice_runner.engine import Engine, SamplingParams, SpecConfig
from openalice_runner.engine.drafters.ngram import NgramIndex

COPY_HEAVY = {"tool_call", "code_edit", "summarize", "rag"}


def passes_with_free_verification(prompt: list[int], reply: list[int], n_max: int, gamma: int) -> int:
    index = NgramIndex(1, n_max)
    index.extend(prompt)
    done = passes = 0
    while done < len(reply):
        draft = index.lookup(gamma)
        accepted = 0
        while accepted < len(draft) and done + accepted < len(reply) and draft[accepted] == reply[done + accepted]:
            accepted += 1
        emitted = min(accepted + 1, len(reply) - done)  # the accepted drafts and one target token
        index.extend(reply[done : done + emitted])
        done += emitted
        passes += 1
    return passes


def prefill_seconds(engine: Engine, prompt: list[int], chunk: int = 512) -> float:
    times = []
    for _ in range(3):
        cache = engine.model.new_cache(1, len(prompt) + 8)
        start = time.perf_counter()
        for i in range(0, len(prompt), chunk):
            engine.model.forward(torch.tensor([prompt[i : i + chunk]]), cache, [0])
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", required=True)
    parser.add_argument("--json", dest="json_out")
    args = parser.parse_args()
    engine = Engine.load(dtype="bf16", max_batch=1)
    rows = []
    for case in load_workload(args.workload):
        prompt = render_case(engine, case)
        off = engine.generate(prompt, SamplingParams(max_tokens=case.max_tokens), SpecConfig(method="off"))
        reply = off.token_ids
        prefill = prefill_seconds(engine, prompt)
        step = (off.stats.total_s - prefill) / max(1, len(reply))
        passes, n_max, gamma = min(
            (passes_with_free_verification(prompt, reply, n, g), n, g) for n in (4, 8) for g in (7, 16, 64)
        )
        ideal_s = prefill + passes * step
        rows.append({
            "case": case.id, "turn_type": case.turn_type, "prompt_tokens": len(prompt), "tokens": len(reply),
            "prefill_s": round(prefill, 3), "step_ms": round(step * 1e3, 2), "n_max": n_max, "gamma": gamma,
            "ideal_tokens_per_pass": round(len(reply) / passes, 3),
            "ideal_vs_off": round(off.stats.total_s / ideal_s, 3),
            "ideal_vs_off_without_prefill": round(len(reply) / passes, 3),
        })  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    copy = [r["ideal_vs_off"] for r in rows if r["turn_type"] in COPY_HEAVY]
    if copy:
        geomean = math.exp(statistics.fmean(math.log(x) for x in copy))
        print(f"copy-heavy geomean of the ideal / off: {geomean:.3f}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"runs": rows}, f, indent=1)


if __name__ == "__main__":
    main()
