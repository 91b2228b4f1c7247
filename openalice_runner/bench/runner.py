"""`openalice-runner bench`: every case with every method, side by side in one process.

Methods:
- `off`, `ngram`, `draft`, `eagle`: the embedded engine (`eagle` needs a trained head);
- `eagle-lookup`: `eagle` drafting by prompt lookup where the context has a match worth it;
- `ngram:G`, `draft:G`, `eagle:G`, `eagle-lookup:G`: the same with γ fixed at G instead of `--gamma`;
- `policy`: method and γ from a policy file, per case's turn type;
- `hf-plain`, `hf-prompt-lookup`: transformers' own `generate` on the same model and dtype
  (the peer to beat); `hf-prompt-lookup` is the faster of 4 and 10 lookup tokens.
All runs are greedy. Within a case the methods run back to back, so slow drifts of a noisy
machine hit them alike; with `--repeat` each row holds the median run (odd counts) or the slower
middle run (even counts), as the report's `kept` says.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from openalice_runner.bench.repeats import kept_label, kept_run
from openalice_runner.bench.workload import COPY_HEAVY, OPEN_ENDED, Case, render_case
from openalice_runner.engine import Engine, SamplingParams, SpecConfig
from openalice_runner.speculation import with_old_keys

ENGINE_METHODS = ("off", "ngram", "draft", "eagle", "eagle-lookup", "eagle-tree", "eagle-lookup-tree")
EAGLE_TREE_NODES = 8  # the bench's draft trees: up to this many tokens (--tree-nodes)
# bench names that are an engine method with options
METHOD_OPTIONS = {
    "eagle-lookup": ("eagle", {"eagle_lookup": True}),
    "eagle-tree": ("eagle", {"eagle_tree": EAGLE_TREE_NODES}),
    "eagle-lookup-tree": ("eagle", {"eagle_lookup": True, "eagle_tree": EAGLE_TREE_NODES}),
}
HF_METHODS = ("hf-plain", "hf-prompt-lookup")
ALL_METHODS = (*ENGINE_METHODS, "policy", *HF_METHODS)
HF_LOOKUP_TOKENS = (4, 10)


@dataclass
class Run:
    tokens: list[int]
    seconds: float
    gamma: int
    acceptance_rate: float | None = None
    tokens_per_pass: float | None = None
    target_passes: int | None = None
    method_used: str | None = None
    rule: str | None = None
    policy_version: str | None = None


def run_engine(engine: Engine, prompt: list[int], max_tokens: int, spec: SpecConfig) -> Run:
    result = engine.generate(prompt, SamplingParams(max_tokens=max_tokens), spec)
    s = result.stats
    return Run(
        tokens=result.token_ids,
        seconds=s.total_s,
        gamma=s.gamma,
        acceptance_rate=s.acceptance_rate,
        tokens_per_pass=s.tokens_per_pass,
        target_passes=s.target_passes,
        method_used=s.method,
    )


def run_hf(engine: Engine, prompt: list[int], max_tokens: int, lookup: int | None) -> Run:
    eos = sorted(engine.eos_token_ids)
    kwargs = {
        "max_new_tokens": max_tokens,
        "do_sample": False,
        "eos_token_id": eos,
        "pad_token_id": eos[0],
        "temperature": None,
        "top_p": None,
        "top_k": None,
    }
    if lookup:
        kwargs["prompt_lookup_num_tokens"] = lookup
    ids = torch.tensor([prompt])
    # transformers' generate runs on torch's threads, which the engine sets to 1 for its own
    # passes (its kernels have their own workers): give it every thread it had
    with engine.torch_work(), torch.inference_mode():
        start = time.perf_counter()
        out = engine.hf_model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
        seconds = time.perf_counter() - start
    tokens = out[0, len(prompt) :].tolist()
    for i, t in enumerate(tokens):  # our engine reports ids without the EOS
        if t in engine.eos_token_ids:
            tokens = tokens[:i]
            break
    return Run(tokens=tokens, seconds=seconds, gamma=lookup or 0)


def median_run(runs: list[Run]) -> Run:
    """The median for an odd count, the slower middle run for an even one (bench/repeats.py)."""
    return kept_run(runs, seconds=lambda r: r.seconds)


def bench(
    engine: Engine,
    cases: list[Case],
    methods: list[str],
    gamma: int = 5,
    repeat: int = 1,
    policy_store=None,
    progress: Callable[[str], None] | None = None,
    eagle_head: str | None = None,
    tree_nodes: int = EAGLE_TREE_NODES,
) -> dict:
    """`tree_nodes`: the most tokens of a draft tree in the tree methods."""
    unknown = [m for m in methods if split_method(m, gamma)[0] not in ALL_METHODS]
    if unknown:
        raise ValueError(f"unknown methods {unknown}; choose from {', '.join(ALL_METHODS)}")
    if "policy" in methods and policy_store is None:
        raise ValueError("method 'policy' needs --policy FILE")
    if any(split_method(m, gamma)[0].startswith("eagle") for m in methods) and not eagle_head:
        raise ValueError("method 'eagle' needs --eagle-head DIR (a head trained with `openalice-runner draft train`)")
    # Warm up allocator, thread pool and caches so the first measured row is not penalised.
    warm = engine.encode("Hello there, how are you?")
    engine.generate(warm, SamplingParams(max_tokens=8), SpecConfig(method="ngram", gamma=3))
    # As the sidecar does at load: time passes of 1 to 17 rows, so drafters size their drafts
    # from real costs. Without it a row count never run is extrapolated from the largest one
    # run (linearly, to be safe), looks dear, and is then never tried: the first method of a
    # run could cap every later method's drafts (n-gram γ 5 drafted 2 tokens a round here).
    engine.time_passes()

    rows = []
    for case in cases:
        prompt = render_case(engine, case)
        reference: list[int] | None = None
        # Repeats go round the methods (off, ngram, ..., off, ngram, ...) rather than one
        # method R times in a row: on a shared machine a slow minute then slows every method
        # of the case alike, and the median of each method compares like with like.
        runs: dict[str, list[Run]] = {m: [] for m in methods}
        for _ in range(repeat):
            for method in methods:
                runs[method].append(_one(engine, case, prompt, method, gamma, policy_store, eagle_head, tree_nodes))
        for method in methods:
            run = median_run(runs[method])
            if method == "off":
                reference = run.tokens
            row = report_row(case, method, run, reference, len(prompt))
            rows.append(row)
            if progress:
                progress(_row_line(row))
    return {"runs": rows, "summary": summarize(rows, methods), "kept": kept_label(repeat)}


def report_row(case: Case, method: str, run: Run, reference: list[int] | None, prompt_tokens: int) -> dict:
    """One row of the `bench` JSON (a contract: the keys are speculation.py's names, with the renamed
    ones also under their old names for one release)."""
    row = {
        "case": case.id,
        "turn_type": case.turn_type,
        "method": method,
        "gamma": run.gamma,
        "tokens": len(run.tokens),
        "seconds": round(run.seconds, 4),
        "tokens_per_second": round(len(run.tokens) / run.seconds, 3) if run.seconds else 0.0,
        "acceptance_rate": None if run.acceptance_rate is None else round(run.acceptance_rate, 4),
        "tokens_per_pass": None if run.tokens_per_pass is None else round(run.tokens_per_pass, 3),
        "target_passes": run.target_passes,
        "identical_to_off": None if reference is None else run.tokens == reference,
        "prompt_tokens": prompt_tokens,
    }
    if method == "policy":
        row.update(policy_method=run.method_used, rule=run.rule, policy_version=run.policy_version)
    return with_old_keys("bench", row)


def split_method(method: str, gamma: int) -> tuple[str, int]:
    """'ngram:8' -> ('ngram', 8); 'ngram' -> ('ngram', gamma)."""
    name, _, fixed = method.partition(":")
    if fixed:
        if name not in ENGINE_METHODS or not fixed.isdigit() or int(fixed) < 1:
            raise ValueError(f"bad method {method!r}: use NAME:GAMMA with NAME one of {ENGINE_METHODS}")
        return name, int(fixed)
    return name, gamma


def _one(engine: Engine, case: Case, prompt: list[int], method: str, gamma: int, policy_store,
         eagle_head: str | None = None, tree_nodes: int = EAGLE_TREE_NODES) -> Run:
    method, gamma = split_method(method, gamma)
    if method in ENGINE_METHODS:
        base, options = METHOD_OPTIONS.get(method, (method, {}))
        if "eagle_tree" in options:
            options = dict(options, eagle_tree=tree_nodes)
        head = eagle_head if base == "eagle" else None
        spec = SpecConfig(method=base, gamma=gamma, eagle_head=head, **options)
        return run_engine(engine, prompt, case.max_tokens, spec)
    if method == "policy":
        from openalice_runner.policies import RequestContext

        decision = policy_store.decide(RequestContext(turn_type=case.turn_type, batch_size=1, provider="local"))
        result = engine.generate(prompt, SamplingParams(max_tokens=case.max_tokens), SpecConfig.from_plan(decision))
        result.stats.rule, result.stats.policy_version = decision.rule, decision.policy_version
        policy_store.observe(case.turn_type, decision.method, "local", result.stats.outcome())
        s = result.stats
        return Run(result.token_ids, s.total_s, s.gamma, s.acceptance_rate, s.tokens_per_pass,
                   s.target_passes, decision.method, str(decision.rule), decision.policy_version)
    if method == "hf-plain":
        return run_hf(engine, prompt, case.max_tokens, None)
    # hf-prompt-lookup: the faster of its two usual settings
    return min((run_hf(engine, prompt, case.max_tokens, n) for n in HF_LOOKUP_TOKENS), key=lambda r: r.seconds)


def geomean(values: list[float]) -> float | None:
    values = [v for v in values if v and v > 0]
    return round(math.exp(statistics.fmean(math.log(v) for v in values)), 3) if values else None


def summarize(rows: list[dict], methods: list[str]) -> dict:
    tps = {(r["case"], r["method"]): r["tokens_per_second"] for r in rows}
    group_of = {r["case"]: r["turn_type"] for r in rows}
    cases = list(dict.fromkeys(r["case"] for r in rows))

    def ratios(a: str, b: str, groups: tuple[str, ...] | None = None) -> list[float]:
        return [
            tps[(c, a)] / tps[(c, b)]
            for c in cases
            if (groups is None or group_of[c] in groups) and tps.get((c, a)) and tps.get((c, b))
        ]

    summary: dict = {"cases": len(cases), "methods": methods}
    for m in methods:
        summary[f"{m}_tokens_per_second_geomean"] = geomean([tps[(c, m)] for c in cases if (c, m) in tps])
    pairs = [(m, "off") for m in methods if m != "off"]
    if "hf-plain" in methods:
        pairs.append(("off", "hf-plain"))
    if "hf-prompt-lookup" in methods and "ngram" in methods:
        pairs.append(("ngram", "hf-prompt-lookup"))
    for a, b in pairs:
        if a not in methods or b not in methods:
            continue
        key = f"{a}_vs_{b}".replace("-", "_")
        summary[key] = {
            "copy_heavy_geomean": geomean(ratios(a, b, COPY_HEAVY)),
            "open_ended_geomean": geomean(ratios(a, b, OPEN_ENDED)),
            "all_geomean": geomean(ratios(a, b)),
            "min": round(min(ratios(a, b)), 3) if ratios(a, b) else None,
            "open_ended_min": round(min(ratios(a, b, OPEN_ENDED)), 3) if ratios(a, b, OPEN_ENDED) else None,
        }
    if "policy" in methods and "off" in methods and "ngram" in methods:
        worst = [tps[(c, "policy")] / max(tps[(c, "off")], tps[(c, "ngram")]) for c in cases]
        summary["policy_vs_best_of_off_ngram_min"] = round(min(worst), 3)
    if "policy" in methods and "off" in methods and "ngram:5" in methods:
        # the policy's bar: per case, the better of no speculation and n-gram with γ fixed at 5
        per_case = {c: tps[(c, "policy")] / max(tps[(c, "off")], tps[(c, "ngram:5")]) for c in cases}
        summary["policy_vs_best_of_off_ngram5"] = {
            "min": round(min(per_case.values()), 3),
            "cases_at_least_0.95": f"{sum(v >= 0.95 for v in per_case.values())}/{len(per_case)}",
            "per_case": {c: round(v, 3) for c, v in per_case.items()},
        }
    copy_cases = [c for c in cases if group_of[c] in COPY_HEAVY]
    if copy_cases:
        summary["copy_heavy_aggregate_tokens_per_second"] = _aggregate_tokens_per_second(rows, methods, copy_cases)
    summary["identical_to_off"] = _identical_to_off(rows, methods)
    return summary


def _aggregate_tokens_per_second(rows: list[dict], methods: list[str], cases: list[str]) -> dict[str, float]:
    """Throughput over `cases` as a whole, per method: all their tokens over all their time."""
    totals = {(r["case"], r["method"]): (r["tokens"], r["seconds"]) for r in rows}
    aggregate = {}
    for m in methods:
        got = [totals[(c, m)] for c in cases if (c, m) in totals]
        if len(got) == len(cases) and sum(t for _, t in got) > 0:
            aggregate[m] = round(sum(n for n, _ in got) / sum(t for _, t in got), 2)
    return aggregate


def _identical_to_off(rows: list[dict], methods: list[str]) -> dict[str, str]:
    """Per method but off: how many of its replies equal speculation off's ("n/m")."""
    identical = {}
    for m in methods:
        flags = [r["identical_to_off"] for r in rows if r["method"] == m and r["identical_to_off"] is not None]
        if m != "off" and flags:
            identical[m] = f"{sum(flags)}/{len(flags)}"
    return identical


def _row_line(row: dict) -> str:
    acc = "" if row["acceptance_rate"] is None else f" acc={row['acceptance_rate']:.2f}"
    mal = "" if row["tokens_per_pass"] is None else f" tok/pass={row['tokens_per_pass']:.2f}"
    same = "" if row["identical_to_off"] is None else f" same={'yes' if row['identical_to_off'] else 'NO'}"
    return (f"{row['case']:<24} {row['method']:<17} {row['tokens']:>4} tok {row['seconds']:>7.2f} s "
            f"{row['tokens_per_second']:>7.2f} tok/s{acc}{mal}{same}")


def format_table(report: dict) -> str:
    """A readable table: tokens/s per case (rows) and method (columns), with ratios to off."""
    rows = report["runs"]
    methods = list(dict.fromkeys(r["method"] for r in rows))
    cases = list(dict.fromkeys((r["case"], r["turn_type"]) for r in rows))
    tps = {(r["case"], r["method"]): r for r in rows}
    head = "| case | turn type | " + " | ".join(methods) + " |"
    lines = [f"rows: {report['kept']} (tokens/s)" if report.get("kept") else "", head, "|" + "---|" * (len(methods) + 2)]
    lines = lines if lines[0] else lines[1:]
    for case, turn in cases:
        cells = []
        off = tps.get((case, "off"))
        for m in methods:
            r = tps[(case, m)]
            cell = f"{r['tokens_per_second']:.1f}"
            if off and m != "off" and off["tokens_per_second"]:
                cell += f" ({r['tokens_per_second'] / off['tokens_per_second']:.2f}×)"
            if r["identical_to_off"] is False:
                cell += " ≠"
            cells.append(cell)
        lines.append(f"| {case} | {turn} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
