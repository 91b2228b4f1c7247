"""`openalice-runner bench-loops`: whole agent conversations through OpenAI-compatible servers.

A loop resends its whole history with every model call, appends the model's reply, then the
tool's result or the user's next message, and calls again. This module drives the conversations
of an `agent-loops.jsonl` workload (format: shared/workloads/README.md) that way, over HTTP,
streamed and greedy, against several targets side by side: for each repeat, each conversation
runs on every target in turn (the first target rotating), so a noisy minute hits them alike.
Each (conversation, target) keeps its run of median wall time for an odd `repeat`, the slower
middle run for an even one (bench/repeats.py; the report's `kept` says which).

Each conversation has a kind, `chat` or `copy_heavy` (replies that copy from the history), which
the summary's ratios are split by: the workload's `kind` field where a conversation has one; without
it `loop-chat-plan` is chat and every other conversation copy-heavy (DEFAULT_CHAT, the rule before
workloads carried the field).

Before the timed runs each target answers `warmup` calls shaped like the workload's first calls
(tools, tool choice, token budget: a constrained call needs the budget its schema takes), under a
line of their own so they seed no cache the timed runs use: a fresh server's one-time costs (lazy loads, a grammar backend's set-up, allocations) stay
out of the first conversation's figures.

Each run of a conversation starts with a line naming the repeat (`Session N.`) in front of its
first message: without it a server that keeps finished histories for prefix reuse (ours,
llama.cpp's prompt cache) would serve the next repeat's first call from the previous one, and
the first call would no longer be the cold one a new conversation makes. Targets see the same
prompts in the same repeat, so greedy outputs stay comparable between them.

Timed per call: time to the first chunk that carries content or a tool call (`ttft_s`), the whole
call (`seconds`), completion tokens and prompt tokens served from the server's cache (usage), and
the sidecar's `speculation` extension where it sends one (with `first_token`: where the time before
the first token went, by part, first_token.py); per conversation the wall time of all its calls
(`seconds`: what the user of the loop waits, the loop's own work included). The summary's
`first_token` adds the parts up per target, first calls and later ones apart (issue 49).

This module is the driver; the parts live by job beside it: loop_workload.py (the conversations),
loop_call.py (one streamed call and its record), loop_conversation.py (one conversation),
loop_summary.py and loop_first_token.py (the summary), loop_report.py (tables, plot). Their public
names are importable from here too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from openalice_runner.bench.loop_call import (
    INFERRED_SUFFIX,
    CallRecord,
    LoopError,
    Target,
    sse_events,
    stream_call,
)
from openalice_runner.bench.loop_conversation import (
    SESSION_LINE,
    _runnable,
    opening_messages,
    run_conversation,
)
from openalice_runner.bench.loop_first_token import first_token_summary
from openalice_runner.bench.loop_long_prompt import probe
from openalice_runner.bench.loop_report import _run_line, format_table, plot
from openalice_runner.bench.loop_summary import (
    compare_outputs,
    geomean,
    inferred_over_stated,
    paired_calls,
    summarize,
)
from openalice_runner.bench.loop_workload import DEFAULT_CHAT, KINDS, Call, Conversation, Step, load_loops
from openalice_runner.bench.repeats import kept_label, kept_run

__all__ = [  # the names other modules and tests import from here, wherever they now live
    "DEFAULT_CHAT", "INFERRED_SUFFIX", "KINDS", "SESSION_LINE", "WARMUP_LINE", "Call", "CallRecord",
    "Conversation", "LoopError", "Step", "Target", "_runnable", "bench_loops", "compare_outputs",
    "first_token_summary", "format_table", "geomean", "inferred_over_stated", "load_loops",
    "opening_messages", "paired_calls", "plot", "run_conversation", "schedule", "served_model",
    "sse_events", "stream_call", "summarize", "warm_up",
]

WARMUP_LINE = "Warm-up {n}.\n"


def schedule(conversations: list[Conversation], targets: list[Target], repeat: int
             ) -> list[tuple[int, Conversation, Target]]:
    """Round-robin: for each repeat and conversation every target in turn, the first one rotating
    (by repeat and conversation) so no target always runs first or right after another one."""
    order = []
    for run in range(repeat):
        for i, conversation in enumerate(conversations):
            k = (run + i) % len(targets)
            for target in targets[k:] + targets[:k]:
                order.append((run, conversation, target))
    return order


def bench_loops(conversations: list[Conversation], targets: list[Target], repeat: int = 1,
                client=None, progress: Callable[[str], None] | None = None, warmup: int = 1,
                before_run: Callable[[], None] | None = None, long_prompt: bool = False) -> dict[str, Any]:
    """`before_run`, when given, is called before every timed conversation: targets that share
    servers (a runner in front of a pool beside the pool itself) reset the servers' prefix caches
    there, so no target finds the prompts another one left behind. `long_prompt`: each repeat
    starts with one long prompt through every target (loop_long_prompt.py)."""
    _check_arguments(targets, warmup)
    own_client = client is None
    if own_client:
        import httpx

        client = httpx.Client(timeout=httpx.Timeout(600.0, connect=10.0))
    runs: dict[tuple[str, str], list[dict]] = {}
    probes: dict[str, list[dict]] = {t.name: [] for t in targets}
    try:
        warmups = _warm_up_all(client, targets, conversations, warmup, progress)
        for run, conversation, target in schedule(conversations, targets, repeat):
            if long_prompt and conversation is conversations[0] and len(probes[target.name]) == run:
                probes[target.name].append(probe(client, target, run))
            if before_run:
                before_run()
            done = run_conversation(client, target, conversation, run)
            runs.setdefault((conversation.id, target.name), []).append(done)
            if progress:
                progress(_run_line(done))
    finally:
        if own_client:
            client.close()
    rows = _kept_rows(conversations, targets, runs)
    names = [t.name for t in targets]
    report = {"kept": kept_label(repeat), "warmup_seconds": warmups, "conversations": rows,
              "summary": summarize(rows, names)}
    report["summary"]["outputs"] = compare_outputs(runs, names)
    report["summary"]["paired_calls"] = paired_calls(runs, names)
    report["summary"]["first_token"] = first_token_summary(rows, names, probes if long_prompt else None)
    return report


def _check_arguments(targets: list[Target], warmup: int) -> None:
    if warmup < 0:
        raise ValueError(f"warmup must be 0 or more, got {warmup}")
    if not targets:
        raise ValueError("no targets to run")
    if len({t.name for t in targets}) != len(targets):
        raise ValueError("target names must be unique")


def _warm_up_all(client, targets: list[Target], conversations: list[Conversation], warmup: int,
                 progress: Callable[[str], None] | None) -> dict[str, list[float]]:
    """First-call costs of a fresh server (lazy loads, allocations) stay out of the timed runs."""
    warmups: dict[str, list[float]] = {}
    for target in targets:
        target.model = target.model or served_model(client, target)
        warmups[target.name] = [round(r.seconds, 4) for r in warm_up(client, target, conversations, warmup)]
        if progress and warmup:
            progress(f"{target.name}: warm-up calls {warmups[target.name]} s")
    return warmups


def _kept_rows(conversations: list[Conversation], targets: list[Target],
               runs: dict[tuple[str, str], list[dict]]) -> list[dict[str, Any]]:
    """One row per (conversation, target): its kept run (bench/repeats.py), calls as JSON."""
    rows = []
    for conversation in conversations:
        for target in targets:
            done = runs[conversation.id, target.name]
            median = kept_run(done, seconds=lambda r: r["seconds"])
            rows.append({
                "id": conversation.id,
                "kind": conversation.kind,
                "target": target.name,
                "seconds": median["seconds"],
                "runs_seconds": [r["seconds"] for r in done],
                "calls": [c.as_json() for c in median["calls"]],
            })
    return rows


def served_model(client, target: Target) -> str:
    response = client.get(f"{target.url}/models")
    models = response.json().get("data") if response.status_code == 200 else None
    if not models:
        raise LoopError(f"{target.name}: GET /models listed no model (HTTP {response.status_code}): {response.text[:300]}")
    return models[0]["id"]


def warm_up(client, target: Target, conversations: list[Conversation], calls: int) -> list[CallRecord]:
    """`calls` untimed calls shaped like the conversations' first calls in turn (their tools, tool
    choice and budget), each opened by a warm-up line: the timed runs' session lines differ from it,
    so no timed call is served from a warm-up's cache."""
    records = []
    for n in range(calls):
        conversation = conversations[n % len(conversations)]
        first = next(s.call for s in conversation.steps if s.kind == "call")
        messages = [dict(m) for m in conversation.messages]
        if isinstance(messages[0].get("content"), str):
            messages[0]["content"] = WARMUP_LINE.format(n=n + 1) + messages[0]["content"]
        call = Call(first.turn_type, first.max_tokens, first.tool_choice)
        records.append(stream_call(client, target, messages, conversation.tools, call, {},
                                   f"warm-up.{target.name}.{n}"))
    return records
