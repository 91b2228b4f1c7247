"""The packed weights on 2 MiB pages against 4 KiB ones (engine/huge_pages.py, issue 49), side by side
in one process: two engines, one built with `OPENALICE_HUGE_PAGES=0`, called in turns.

    python -m openalice_runner.bench.huge_pages [--gaps 0.05,0.2,1,3] [--rounds 7] [--json OUT]

- After idle gaps: for each round and gap, each engine (the order alternating round by round) waits the
  gap, then prefills a fresh 40-token prompt and chooses one token (`generate`, max_tokens 1): the
  time to the first token of a call that comes after an agent's tool ran.
- Hot passes: the same forward on both engines pass by pass (1, 5 and 9 decode rows on 800 tokens of
  context, logits included, and a 64-row prompt chunk), `--passes` each; medians.

Reported per row: each side's median in ms and the ratio 4 KiB / 2 MiB (above 1: the huge pages are
faster), and how much of the huge-page engine's packed weights the kernel did back with huge pages
(AnonHugePages of their mappings: 0 where THP is `never`, and the two sides are then alike).
`--tiny`: the tiny random model (the bench's own test).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from openalice_runner.cli.common import write_report
from openalice_runner.engine import Engine, SamplingParams, huge_pages

SIDES = ("huge", "4k")
PROMPT_TOKENS = 40
CONTEXT = 800
PASSES = ((1, False), (5, False), (9, False), (64, True))  # (rows, prompt rows)


def load_pair(load: Callable[[], Engine]) -> dict[str, Engine]:
    """The same model twice: packed weights on the huge-page arena, and on malloc's 4 KiB pages."""
    huge = load()
    previous = os.environ.get(huge_pages.DISABLE_ENV)
    os.environ[huge_pages.DISABLE_ENV] = "0"
    try:
        small = load()
    finally:
        if previous is None:
            os.environ.pop(huge_pages.DISABLE_ENV)
        else:
            os.environ[huge_pages.DISABLE_ENV] = previous
    return {"huge": huge, "4k": small}


def huge_backed_bytes(engine: Engine) -> tuple[int, int]:
    """(bytes of the packed weights' mappings on huge pages, bytes of the packed weights)."""
    model = engine.model
    linears = [lin for layer in model.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    linears.append(model.lm_head)
    packed = [lin.packed.data for lin in linears if lin.packed is not None]
    total = sum(t.numel() * t.element_size() for t in packed)
    chunks = {(m.start, m.end): m for m in map(huge_pages.mapping_of, (t.data_ptr() for t in packed))}
    backed = sum(m.anon_huge_bytes for m in chunks.values())  # the arena's chunks, each once
    return backed, total


def _row(seconds: dict[str, list[float]]) -> dict[str, Any]:
    huge, small = statistics.median(seconds["huge"]), statistics.median(seconds["4k"])
    return {"huge_ms": round(1e3 * huge, 2), "4k_ms": round(1e3 * small, 2), "ratio": round(small / huge, 3),
            "runs_ms": {side: [round(1e3 * s, 1) for s in seconds[side]] for side in SIDES}}


def after_idle(engines: dict[str, Engine], gaps: list[float], rounds: int) -> dict[str, Any]:
    text = " ".join(f"item {i} of the list, with a note on its state and owner" for i in range(400))
    ids = engines["huge"].encode(text)
    sampling = SamplingParams(max_tokens=1, temperature=0)
    for engine in engines.values():  # warm: kernels built, first passes done
        for i in range(3):
            engine.generate(ids[i * 50 : i * 50 + PROMPT_TOKENS], sampling)
    runs: dict[float, dict[str, list[float]]] = {gap: {side: [] for side in SIDES} for gap in gaps}
    k = 0
    for r in range(rounds):
        for gap in gaps:
            for side in SIDES if r % 2 == 0 else SIDES[::-1]:
                time.sleep(gap)
                k += 1
                start = 200 + (k * PROMPT_TOKENS) % max(1, len(ids) - 300)  # a prompt no cache holds
                t0 = time.perf_counter()
                engines[side].generate(ids[start : start + PROMPT_TOKENS], sampling)
                runs[gap][side].append(time.perf_counter() - t0)
    return {str(gap): _row(runs[gap]) for gap in gaps}


@torch.inference_mode()
def hot_passes(engines: dict[str, Engine], passes: int) -> dict[str, Any]:
    tokens = torch.randint(100, 1000, (1, CONTEXT + 64))
    states = {}
    for side, engine in engines.items():
        cache = engine.model.new_cache(1, CONTEXT + 128)
        engine.model.forward(tokens[:, :CONTEXT], cache, prompt=True)
        states[side] = (engine.model, cache)
    runs = {(rows, prompt): {side: [] for side in SIDES} for rows, prompt in PASSES}
    for r in range(passes):
        for rows, prompt in PASSES:
            for side in SIDES if r % 2 == 0 else SIDES[::-1]:
                model, cache = states[side]
                t0 = time.perf_counter()
                hidden = model.forward(tokens[:, CONTEXT : CONTEXT + rows], cache, prompt=prompt)
                model.logits(hidden[0][-1:] if prompt else hidden[0])
                runs[(rows, prompt)][side].append(time.perf_counter() - t0)
                cache.lengths[0] -= rows
    return {f"{rows} {'prompt' if prompt else 'decode'} rows": _row(runs[(rows, prompt)]) for rows, prompt in PASSES}


def run(gaps: list[float], rounds: int, passes: int, tiny: bool = False) -> dict[str, Any]:
    engines = load_pair((lambda: Engine.tiny_random(dtype="bf16")) if tiny else Engine.load)
    backed, total = huge_backed_bytes(engines["huge"])
    return {
        "packed_weight_bytes": total,
        "on_huge_pages_bytes": backed,
        "after_idle_s": after_idle(engines, gaps, rounds),
        "hot_passes": hot_passes(engines, passes),
    }


def format_report(report: dict[str, Any]) -> str:
    lines = [f"packed weights {report['packed_weight_bytes'] / 2**20:.0f} MiB, "
             f"{report['on_huge_pages_bytes'] / 2**20:.0f} MiB of their mappings on huge pages", "",
             "| after an idle gap of | 2 MiB pages, ms | 4 KiB pages, ms | 4 KiB / 2 MiB |", "|---|---|---|---|"]
    for gap, row in report["after_idle_s"].items():
        lines.append(f"| {gap} s | {row['huge_ms']} | {row['4k_ms']} | {row['ratio']} |")
    lines += ["", "| hot pass | 2 MiB pages, ms | 4 KiB pages, ms | 4 KiB / 2 MiB |", "|---|---|---|---|"]
    for name, row in report["hot_passes"].items():
        lines.append(f"| {name} | {row['huge_ms']} | {row['4k_ms']} | {row['ratio']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m openalice_runner.bench.huge_pages", description=__doc__.split("\n")[0])
    parser.add_argument("--gaps", default="0.05,0.2,1,3", help="idle seconds before a call, comma-separated")
    parser.add_argument("--rounds", type=int, default=7, help="calls per gap and side (odd: a true median)")
    parser.add_argument("--passes", type=int, default=21, help="hot passes per shape and side")
    parser.add_argument("--tiny", action="store_true", help="the tiny random model (for tests)")
    parser.add_argument("--json", dest="json_out", help="write the report here")
    args = parser.parse_args(argv)
    try:
        gaps = [float(g) for g in args.gaps.split(",")]
    except ValueError:
        parser.error(f"--gaps: comma-separated seconds, got {args.gaps!r}")
    if any(g < 0 for g in gaps) or args.rounds < 1 or args.passes < 1:
        parser.error("--gaps must be >= 0, --rounds and --passes >= 1")
    report = run(gaps, args.rounds, args.passes, tiny=args.tiny)
    print(format_report(report))
    write_report(args.json_out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
