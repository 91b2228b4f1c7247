"""`bench-loops`' summary of the kept runs: per target its totals and TTFT medians, per pair of
targets the speedups (all, copy-heavy, chat; per token; the -inferred twins over the stated pair),
the outputs against `off`'s, and the calls paired across targets."""

from __future__ import annotations

import math
import statistics
from typing import Any

from openalice_runner.bench.loop_call import INFERRED_SUFFIX


def geomean(values: list[float]) -> float | None:
    values = [v for v in values if v and v > 0]
    if not values:
        return None
    return round(math.exp(sum(math.log(v) for v in values) / len(values)), 3)


def summarize(rows: list[dict], targets: list[str]) -> dict[str, Any]:
    """Per target: total and geomean wall time, TTFT p50 of first and later calls; per pair of
    targets (earlier over later in the target list): geomean over conversations of the later's
    wall time over the earlier's (above 1: the earlier is faster), all, copy-heavy and chat apart."""
    by = {(r["id"], r["target"]): r for r in rows}
    ids = list(dict.fromkeys(r["id"] for r in rows))
    kinds = {r["id"]: r["kind"] for r in rows}
    per_target = {}
    for name in targets:
        mine = [by[i, name] for i in ids if (i, name) in by]
        first = [r["calls"][0]["ttft_s"] for r in mine if r["calls"]]
        later = [c["ttft_s"] for r in mine for c in r["calls"][1:]]
        p50_first = statistics.median(first) if first else None
        p50_later = statistics.median(later) if later else None
        per_target[name] = {
            "conversations": len(mine),
            "seconds_total": round(sum(r["seconds"] for r in mine), 3),
            "seconds_geomean": geomean([r["seconds"] for r in mine]),
            "ttft_p50_first_s": None if p50_first is None else round(p50_first, 4),
            "ttft_p50_later_s": None if p50_later is None else round(p50_later, 4),
            "ttft_later_over_first": round(p50_later / p50_first, 3) if p50_first and p50_later is not None else None,
            "completion_tokens": sum(c["completion_tokens"] or 0 for r in mine for c in r["calls"]),
            "ms_per_token": _ms_per_token(mine),
            "cached_tokens": sum(c["cached_tokens"] or 0 for r in mine for c in r["calls"]),
        }
    ratios = {}
    for a, name in enumerate(targets):
        for other in targets[a + 1:]:
            pairs = [(i, by[i, other]["seconds"] / by[i, name]["seconds"]) for i in ids
                     if (i, name) in by and (i, other) in by and by[i, name]["seconds"] > 0]
            ratios[f"{name}/{other}"] = {
                "all": geomean([x for _, x in pairs]),
                "copy_heavy": geomean([x for i, x in pairs if kinds[i] == "copy_heavy"]),
                "chat": geomean([x for i, x in pairs if kinds[i] == "chat"]),
            }
    # Wall time over tokens written: targets whose replies differ in length (a peer that ignores the
    # tools writes short chat replies instead of calls) compared per token, not per conversation.
    per_token = {}
    for a, name in enumerate(targets):
        for other in targets[a + 1:]:
            mine, theirs = per_target[name]["ms_per_token"], per_target[other]["ms_per_token"]
            per_token[f"{name}/{other}"] = round(theirs / mine, 3) if mine and theirs else None
    return {"targets": per_target, "speedup": ratios, "speedup_per_token": per_token,
            "inferred_over_stated": inferred_over_stated(ratios)}


def inferred_over_stated(ratios: dict[str, dict[str, float | None]]) -> dict[str, dict[str, float | None]]:
    """For each pair A/B whose twins A-inferred/B-inferred ran too: the twins' speedup over the pair's
    (1: inferring the turn types loses nothing of what stating them gains)."""
    out = {}
    for pair, stated in ratios.items():
        a, b = pair.split("/")
        inferred = ratios.get(f"{a}{INFERRED_SUFFIX}/{b}{INFERRED_SUFFIX}")
        if inferred is None or a.endswith(INFERRED_SUFFIX):
            continue
        out[pair] = {k: round(inferred[k] / stated[k], 3) if inferred[k] and stated[k] else None for k in stated}
    return out


def _ms_per_token(rows: list[dict]) -> float | None:
    """All calls' wall time over all their completion tokens (ms)."""
    seconds = sum(c["seconds"] for r in rows for c in r["calls"])
    tokens = sum(c["completion_tokens"] or 0 for r in rows for c in r["calls"])
    return round(1000 * seconds / tokens, 3) if tokens else None


def compare_outputs(runs: dict[tuple[str, str], list[dict]], targets: list[str]) -> dict[str, Any]:
    """Every target's outputs against `off`'s, call by call, in the same repeat (same prompts)."""
    if "off" not in targets:
        return {}
    out = {}
    for name in targets:
        if name == "off":
            continue
        same = total = 0
        mismatches = []
        for (conversation, target), done in runs.items():
            if target != name or (conversation, "off") not in runs:
                continue
            reference = {r["run"]: r for r in runs[conversation, "off"]}
            for r in done:
                ref = reference.get(r["run"])
                if ref is None:
                    continue
                for k, (mine, theirs) in enumerate(zip(r["calls"], ref["calls"], strict=False)):
                    total += 1
                    if mine.output == theirs.output:
                        same += 1
                    else:
                        mismatches.append({"id": conversation, "run": r["run"], "call": k,
                                           "first_difference": _first_difference(mine.output, theirs.output)})
        out[name] = {"identical_to_off": f"{same}/{total}", "mismatches": mismatches}
    return out


def paired_calls(runs: dict[tuple[str, str], list[dict]], targets: list[str]) -> dict[str, Any]:
    """Per pair of targets (earlier minus later): the median over calls of the difference in TTFT
    and in call time, each call paired with the same call (conversation, repeat, index) of the
    other target, over the calls whose outputs agree (same work on both sides). With a runner in
    front of a pool and the pool itself as the two targets, this is the runner's cost per call."""
    out = {}
    for a, name in enumerate(targets):
        for other in targets[a + 1:]:
            ttft, seconds, total = [], [], 0
            for (conversation, target), done in runs.items():
                if target != name or (conversation, other) not in runs:
                    continue
                theirs = {r["run"]: r for r in runs[conversation, other]}
                for r in done:
                    if r["run"] not in theirs:
                        continue
                    for mine, ref in zip(r["calls"], theirs[r["run"]]["calls"], strict=False):
                        total += 1
                        if mine.output == ref.output:
                            ttft.append(mine.ttft_s - ref.ttft_s)
                            seconds.append(mine.seconds - ref.seconds)
            out[f"{name}-{other}"] = {
                "calls_paired": f"{len(ttft)}/{total}",
                "ttft_p50_ms": round(1000 * statistics.median(ttft), 2) if ttft else None,
                "seconds_p50_ms": round(1000 * statistics.median(seconds), 2) if seconds else None,
            }
    return out


def _first_difference(a: str, b: str) -> int:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))
