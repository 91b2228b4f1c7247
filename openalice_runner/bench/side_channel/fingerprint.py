"""Which prompt was sent, told from the stream alone, under each release mode (issue 48, Build 4).

K prompts x R repeats, at each temperature, with n-gram and with suffix speculation (the policy
picks the method from the turn type the bench states), through one `serve` per release mode, all
started here. Calls go one at a time, round-robin over the modes call by call (drift on a shared
CPU hits every mode alike), the prompts in a new order each repeat. Each stream is recorded as a
network observer sees it (`observe`), and classified by leave-one-out nearest neighbour
(`classify`) within its (mode, method, temperature) cell: chance is 1/K.

Every reply is cut by the same budget where it can be: a reply's length is a channel of its own
(any release mode shows how much was sent), which padding the length would close; the report
counts the replies that ended before the budget.
"""

from __future__ import annotations

import random
import statistics
import tempfile
from pathlib import Path
from typing import Any

from openalice_runner.bench.side_channel.classify import OBSERVERS, accuracy
from openalice_runner.bench.side_channel.observe import Observation, observe

PROMPTS = (
    "Repeat this sentence five times: The quick brown fox jumps over the lazy dog.",
    "Write a short poem about autumn leaves falling in a quiet park.",
    "List the numbers from one to forty, in words, separated by commas.",
    "Write a Python function that returns the factorial of n, with a docstring.",
    "Explain what a hash table is and when to use one.",
    "Copy this JSON back unchanged: {\"name\": \"Ada Lovelace\", \"born\": 1815, \"langs\": [\"en\", \"fr\", "
    "\"it\"], \"works\": [\"Notes on the Analytical Engine\", \"Sketch of the Analytical Engine\"], \"id\": 1815}",
    "Give three tips for writing clear emails at work.",
    "Describe the water cycle to a ten-year-old.",
)
# `off` is the control: what an observer tells from a stream with no speculation at all (the
# prompt's length in the time to the first write, the reply's in the number of writes) is the floor
# no release mode goes below; the speculation's own channel is what the other methods add to it
METHODS = ("off", "ngram", "suffix")
MODES = ("pass", "fixed:4", "paced")
TEMPERATURES = (0.0, 0.7)
# one rule per method, chosen by the turn type the bench states
POLICY = """\
version: 1
name: side-channel
description: the fingerprinting bench's methods, one per stated turn type
rules:
  - {name: "off", match: {turn_type: fp-off}, method: "off"}
  - {name: ngram, match: {turn_type: fp-ngram}, method: ngram, gamma: 4}
  - {name: suffix, match: {turn_type: fp-suffix}, method: suffix, gamma: 4}
default: {method: "off"}
"""


def run(prompts: tuple[str, ...] = PROMPTS, repeats: int = 6, modes: tuple[str, ...] = MODES,
        methods: tuple[str, ...] = METHODS, temperatures: tuple[float, ...] = TEMPERATURES,
        max_tokens: int = 40, providers: str | None = None, seed: int = 0, equal_prompts: bool = False,
        log=print, checkpoint=None) -> dict[str, Any]:
    """`equal_prompts`: each prompt padded (" x" words) to the longest one's token count first, so
    the time to the first write no longer tells prompts apart by their length (a channel of its own,
    with or without speculation). `checkpoint`: given the report of the streams so far after each
    repeat and temperature (a long run on a loaded machine keeps what it measured)."""
    import httpx

    from openalice_runner.bench.loop_targets import Servers, TargetSpec

    with tempfile.TemporaryDirectory(prefix="side-channel-") as tmp:
        policy = Path(tmp) / "policy.yaml"
        policy.write_text(POLICY)
        with Servers(policy=str(policy), providers=providers, log=log) as servers, \
                httpx.Client(timeout=httpx.Timeout(600.0, connect=10.0)) as client:
            urls = {mode: servers.start(TargetSpec(mode, sidecar="policy", args=["--stream-release", mode])).url
                    for mode in modes}
            lengths = prompt_tokens(client, urls[modes[0]], prompts)
            if equal_prompts:
                prompts = equalised(client, urls[modes[0]], prompts, lengths)
                lengths = prompt_tokens(client, urls[modes[0]], prompts)
            warm_up(client, urls, prompts, max_tokens, methods)
            def partial(observations: list[Observation], done: int) -> None:
                if checkpoint is not None:
                    checkpoint(report(observations, len(prompts), done, max_tokens))

            observations = _observe_all(urls, prompts, repeats, methods, temperatures, max_tokens, seed, log,
                                        client, partial)
    rep = report(observations, len(prompts), repeats, max_tokens)
    rep["prompt_tokens"], rep["equal_prompts"] = lengths, equal_prompts
    return rep


def prompt_tokens(client, url: str, prompts: tuple[str, ...]) -> list[int]:
    """Each prompt's token count as the server counts it (a one-token call's usage)."""
    counts = []
    for prompt in prompts:
        body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 1, "temperature": 0}
        response = client.post(f"{url}/chat/completions", json=body)
        response.raise_for_status()
        counts.append(response.json()["usage"]["prompt_tokens"])
    return counts


def equalised(client, url: str, prompts: tuple[str, ...], counts: list[int]) -> tuple[str, ...]:
    """Each prompt padded with " x" (one token a word in the SmolLM2 and GPT-2 vocabularies) to the
    longest one's count; a pad that the tokenizer merges otherwise is corrected once."""
    target = max(counts)
    padded = tuple(p + " x" * (target - n) for p, n in zip(prompts, counts, strict=True))
    again = prompt_tokens(client, url, padded)
    return tuple(p + " x" * max(0, target - n) for p, n in zip(padded, again, strict=True))


def warm_up(client, urls: dict[str, str], prompts: tuple[str, ...], max_tokens: int,
            methods: tuple[str, ...] = METHODS) -> None:
    """A streamed call of every prompt through every server under each method's turn type, not
    observed: the engine's first calls and each clock's first rate (recent streams of the tenant,
    model and turn type) are set before the run."""
    for url in urls.values():
        for method in methods:
            for prompt in prompts:
                body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                        "temperature": 0, "stream": True}
                observe(client, url, body, {"X-OpenAlice-Turn-Type": f"fp-{method}"},
                        Observation(-1, "", method, 0.0))


def _observe_all(urls: dict[str, str], prompts, repeats, methods, temperatures, max_tokens, seed, log,
                 client, partial) -> list[Observation]:
    rng = random.Random(seed)
    modes = list(urls)
    out: list[Observation] = []
    for r in range(repeats):
        for temperature in temperatures:
            for method in methods:
                order = list(range(len(prompts)))
                rng.shuffle(order)
                for i, k in enumerate(order):
                    shift = (r + i) % len(modes)  # the first mode rotates call by call
                    for mode in modes[shift:] + modes[:shift]:
                        body = {"messages": [{"role": "user", "content": prompts[k]}], "max_tokens": max_tokens,
                                "temperature": temperature, "stream": True,
                                "stream_options": {"include_usage": True}}
                        headers = {"X-OpenAlice-Turn-Type": f"fp-{method}"}
                        obs = Observation(k, mode, method, temperature)
                        out.append(observe(client, urls[mode], body, headers, obs))
            log(f"repeat {r + 1}/{repeats}, temperature {temperature}: {len(out)} streams")
            partial(out, r + 1)
    return out


def report(observations: list[Observation], k: int, repeats: int, max_tokens: int) -> dict[str, Any]:
    cells: dict[tuple[str, str, float], list[Observation]] = {}
    for o in observations:
        cells.setdefault((o.mode, o.method, o.temperature), []).append(o)
    rows = []
    for (mode, method, temperature), obs in sorted(cells.items()):
        accepted = [o.speculation.get("accepted") for o in obs if o.speculation and "accepted" in o.speculation]
        rows.append({
            "mode": mode, "method": method, "temperature": temperature, "streams": len(obs),
            "accuracy": {name: round(accuracy(obs, name), 3) for name in OBSERVERS},
            "reads_per_stream_p50": statistics.median(len(o.reads) for o in obs),
            "write_sizes": sorted({n for o in obs for n in o.sizes})[:16],  # the distinct sizes seen (16 smallest)
            "seconds_p50": round(statistics.median(o.reads[-1][0] for o in obs if o.reads), 3),
            "first_read_s_p50": round(statistics.median(o.reads[0][0] for o in obs if o.reads), 3),
            "ended_before_budget": sum(o.finish_reason != "length" for o in obs),
            "accepted_drafts_shown": sum(accepted) if accepted else None,
        })
    chance = 1 / k
    return {"prompts": k, "repeats": repeats, "max_tokens": max_tokens, "chance": round(chance, 3),
            "rows": rows, "same_output_as_pass": same_output(observations), "summary": summary(rows, chance),
            # every stream as the observer saw it, to classify again with other features
            "observations": [{"label": o.label, "mode": o.mode, "method": o.method, "temperature": o.temperature,
                              "head": round(o.head, 6), "reads": [(round(t, 6), n) for t, n in o.reads],
                              "finish_reason": o.finish_reason, "text_chars": len(o.text)}
                             for o in observations]}


def same_output(observations: list[Observation]) -> dict[str, str]:
    """At temperature 0 every mode must send the text `pass` sends for the same prompt and method
    (releasing differently changes no token): mode -> equal/compared."""
    greedy = [o for o in observations if o.temperature == 0]
    reference = {(o.label, o.method): o.text for o in greedy if o.mode == "pass"}
    out = {}
    for mode in sorted({o.mode for o in greedy} - {"pass"}):
        pairs = [(o.text, reference.get((o.label, o.method))) for o in greedy if o.mode == mode]
        out[mode] = f"{sum(a == b for a, b in pairs)}/{len(pairs)}"
    return out


def summary(rows: list[dict[str, Any]], chance: float) -> dict[str, Any]:
    """Per mode and temperature the best observer's accuracy over both methods, and the issue's bars:
    `pass` at least 5x chance (the channel is there to close), the others at most chance + 10 points."""
    best: dict[str, dict[str, float]] = {}
    floor: dict[str, dict[str, float]] = {}  # the `off` control's best observer
    for row in rows:
        cells = floor if row["method"] == "off" else best
        cell = cells.setdefault(row["mode"], {})
        key = f"{row['temperature']:g}"
        cell[key] = max(cell.get(key, 0.0), *row["accuracy"].values())
    bars = {}
    for mode, by_t in best.items():
        bars[mode] = all(a >= 5 * chance for a in by_t.values()) if mode == "pass" else all(
            a <= chance + 0.10 for a in by_t.values())
    over_off = {mode: {t: round(a - floor.get(mode, {}).get(t, 0.0), 3) for t, a in by_t.items()}
                for mode, by_t in best.items()}
    return {"best_accuracy": best, "off_accuracy": floor, "speculation_over_off": over_off, "meets_bar": bars}


def format_table(rep: dict[str, Any]) -> str:
    lines = [f"chance {rep['chance']:.3f} ({rep['prompts']} prompts x {rep['repeats']} repeats, "
             f"max_tokens {rep['max_tokens']}); prompt tokens {rep.get('prompt_tokens')}"
             f"{' (padded to one length)' if rep.get('equal_prompts') else ''}", "",
             "| mode | method | T | streams | " + " | ".join(OBSERVERS) + " | reads p50 | s p50 | first read s | ended early |",
             "|---|---|---|---|" + "---|" * len(OBSERVERS) + "---|---|---|---|"]
    for r in rep["rows"]:
        a = r["accuracy"]
        lines.append(f"| {r['mode']} | {r['method']} | {r['temperature']:g} | {r['streams']} | "
                     + " | ".join(f"{a[name]:.3f}" for name in OBSERVERS)
                     + f" | {r['reads_per_stream_p50']:g} | {r['seconds_p50']} | "
                     f"{r['first_read_s_p50']} | {r['ended_before_budget']} |")
    summ = rep["summary"]
    lines += ["", f"same output as pass at T=0: {rep['same_output_as_pass']}",
              f"best observer, speculation on (ngram, suffix): {summ['best_accuracy']}",
              f"best observer, speculation off (the control): {summ['off_accuracy']}",
              f"speculation's own share (on minus off): {summ['speculation_over_off']}",
              f"meets the bar: {summ['meets_bar']}"]
    return "\n".join(lines)
