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
"""

from __future__ import annotations

import json
import math
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from openalice_runner.bench.repeats import kept_label, kept_run
from openalice_runner.workload_files import json_lines, pick_by_id, stdlib_context

KINDS = ("chat", "copy_heavy")
DEFAULT_CHAT = ("loop-chat-plan",)  # without a `kind` field: chat; every other conversation copy-heavy
SESSION_LINE = "Session {n}.\n"
INFERRED_SUFFIX = "-inferred"  # a built-in target's twin that states no turn types (Target.stated)
WARMUP_LINE = "Warm-up {n}.\n"


class LoopError(RuntimeError):
    """A target answered a call with an error (or not in the streamed OpenAI shape)."""


# ---- the workload ---------------------------------------------------------------------------
@dataclass
class Call:
    turn_type: str
    max_tokens: int
    tool_choice: Any = None  # None: not sent (the server's default)
    expect_tool_call: dict[str, Any] | None = None


@dataclass
class Step:
    kind: str  # "call" | "tool_result" | "user"
    call: Call | None = None
    text: str = ""


@dataclass
class Conversation:
    id: str
    tools: list[dict[str, Any]]
    messages: list[dict[str, Any]]
    steps: list[Step]
    kind: str = "copy_heavy"  # "chat" | "copy_heavy": what the summary's ratios are split by


def load_loops(path: str | Path, ids: list[str] | None = None) -> list[Conversation]:
    """The conversations of an agent-loops workload; a malformed one names FILE:LINE and the field."""
    conversations = []
    for n, raw in json_lines(path):
        where = f"{path}:{n}"
        try:
            conversations.append(_conversation(raw))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{where}: {exc}") from exc
    return pick_by_id(conversations, ids, "conversation")


def _conversation(raw: dict[str, Any]) -> Conversation:
    if not isinstance(raw.get("id"), str):
        raise ValueError("`id` must be a string")
    if not isinstance(raw.get("messages"), list) or not raw["messages"]:
        raise ValueError("`messages` must be a non-empty list")
    steps = []
    for i, step in enumerate(raw.get("steps") or []):
        if "call" in step:
            c = step["call"]
            if not isinstance(c.get("turn_type"), str) or not isinstance(c.get("max_tokens"), int):
                raise ValueError(f"steps[{i}].call needs `turn_type` (string) and `max_tokens` (integer)")
            steps.append(Step("call", Call(c["turn_type"], c["max_tokens"], c.get("tool_choice"),
                                           c.get("expect_tool_call"))))
        elif "tool_result" in step:
            context = stdlib_context(step["context"]) if step.get("context") else ""
            steps.append(Step("tool_result", text=str(step["tool_result"]).replace("{context}", context)))
        elif "user" in step:
            steps.append(Step("user", text=str(step["user"])))
        else:
            raise ValueError(f"steps[{i}] must hold `call`, `tool_result` or `user`")
    if not any(s.kind == "call" for s in steps):
        raise ValueError("`steps` holds no call")
    kind = raw.get("kind", "chat" if raw["id"] in DEFAULT_CHAT else "copy_heavy")
    if kind not in KINDS:
        raise ValueError(f"`kind` must be one of {', '.join(KINDS)}, got {kind!r}")
    return Conversation(raw["id"], list(raw.get("tools") or []), list(raw["messages"]), steps, kind)


# ---- one call, streamed ---------------------------------------------------------------------
@dataclass
class Target:
    name: str
    url: str  # the API base, ending in /v1
    model: str | None = None  # None: the first model its GET /models lists
    # False: the calls go over the Messages wire as Claude Code sends them, with no X-OpenAlice-*
    # headers, only its session id: the sidecar infers the turn types (bench/loop_messages.py)
    stated: bool = True


@dataclass
class CallRecord:
    turn_type: str
    ttft_s: float
    seconds: float
    completion_tokens: int | None
    cached_tokens: int | None
    prompt_tokens: int | None
    speculation: dict[str, Any] | None
    content: str
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: str | None = None
    tokens_counted: str = "usage"  # or "chunks": the server sent no usage; one streamed chunk a token

    def as_json(self) -> dict[str, Any]:
        return {
            "turn_type": self.turn_type,
            "ttft_s": round(self.ttft_s, 4),
            "seconds": round(self.seconds, 4),
            "completion_tokens": self.completion_tokens,
            "cached_tokens": self.cached_tokens,
            "prompt_tokens": self.prompt_tokens,
            "speculation": self.speculation,
            "finish_reason": self.finish_reason,
            "tokens_counted": self.tokens_counted,
            "output": self.output,
        }

    @property
    def output(self) -> str:
        """What the call produced, as compared between targets: content and tool calls."""
        calls = [(c["function"]["name"], c["function"]["arguments"]) for c in self.tool_calls]
        return self.content if not calls else json.dumps({"content": self.content, "tool_calls": calls})


def sse_events(lines: Iterator[str]) -> Iterator[dict[str, Any]]:
    for line in lines:
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        try:
            event = json.loads(data)
        except json.JSONDecodeError as exc:
            raise LoopError(f"not JSON in the stream: {data[:200]!r}") from exc
        if "error" in event:
            raise LoopError(f"error in the stream: {json.dumps(event['error'])[:500]}")
        yield event


def stream_call(client, target: Target, messages: list[dict], tools: list[dict], call: Call,
                headers: dict[str, str], conversation_key: str | None = None) -> CallRecord:
    """One greedy streamed Chat Completions call; the clock starts before the request is sent. The
    conversation goes as X-OpenAlice-Conversation-Id."""
    if conversation_key is not None:
        headers = {"X-OpenAlice-Conversation-Id": conversation_key, **headers}
    body: dict[str, Any] = {
        "model": target.model,
        "messages": messages,
        "max_tokens": call.max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if tools:
        body["tools"] = tools
    if call.tool_choice is not None:
        body["tool_choice"] = call.tool_choice
    content: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    usage: dict[str, Any] | None = None
    speculation = finish = None
    ttft = None
    chunks = 0  # chunks that carry text or a call: tokens, for a server that sends no usage
    t0 = time.perf_counter()
    with client.stream("POST", f"{target.url}/chat/completions", json=body, headers=headers) as response:
        if response.status_code != 200:
            response.read()
            raise LoopError(f"{target.name}: HTTP {response.status_code}: {response.text[:500]}")
        for event in sse_events(response.iter_lines()):
            usage = event.get("usage") or usage
            speculation = event.get("speculation") or speculation
            for choice in event.get("choices") or []:
                delta = choice.get("delta") or {}
                finish = choice.get("finish_reason") or finish
                if delta.get("content"):
                    content.append(delta["content"])
                for d in delta.get("tool_calls") or []:
                    entry = calls.setdefault(d.get("index", 0),
                                             {"id": None, "type": "function", "function": {"name": "", "arguments": ""}})
                    entry["id"] = d.get("id") or entry["id"]
                    fn = d.get("function") or {}
                    entry["function"]["name"] += fn.get("name") or ""
                    entry["function"]["arguments"] += fn.get("arguments") or ""
                if delta.get("content") or delta.get("tool_calls"):
                    chunks += 1
                    if ttft is None:
                        ttft = time.perf_counter() - t0
    seconds = time.perf_counter() - t0
    usage = usage or {}
    details = usage.get("prompt_tokens_details") or {}
    return CallRecord(
        turn_type=call.turn_type,
        ttft_s=seconds if ttft is None else ttft,
        seconds=seconds,
        completion_tokens=usage.get("completion_tokens", chunks),
        cached_tokens=details.get("cached_tokens"),
        prompt_tokens=usage.get("prompt_tokens"),
        speculation=speculation,
        content="".join(content),
        tool_calls=[calls[i] for i in sorted(calls)],
        finish_reason=finish,
        tokens_counted="usage" if "completion_tokens" in usage else "chunks",
    )


# ---- one conversation -----------------------------------------------------------------------
def opening_messages(conversation: Conversation, run: int) -> list[dict[str, Any]]:
    """The conversation's opening messages, the first one led by the run's session line."""
    messages = [dict(m) for m in conversation.messages]
    first = messages[0]
    if isinstance(first.get("content"), str):
        first["content"] = SESSION_LINE.format(n=run + 1) + first["content"]
    return messages


def _runnable(call: dict[str, Any]) -> bool:
    """A streamed call a loop can run: its arguments are a JSON object (a call cut by max_tokens
    streams arguments that stop short; the loop answers the expected call instead)."""
    try:
        return isinstance(json.loads(call["function"]["arguments"] or "{}"), dict)
    except json.JSONDecodeError:
        return False


def run_conversation(client, target: Target, conversation: Conversation, run: int) -> dict[str, Any]:
    """Drive one conversation as a loop does; returns its record (wall time, calls, outputs)."""
    from openalice_runner.bench.loop_messages import messages_call  # it reads this module's records
    messages = opening_messages(conversation, run)
    key = f"{conversation.id}.{target.name}.{run}"
    records: list[CallRecord] = []
    last_call_id: str | None = None
    t0 = time.perf_counter()
    for i, step in enumerate(conversation.steps):
        if step.kind == "call":
            call = step.call
            if target.stated:
                headers = {"X-OpenAlice-Turn-Type": call.turn_type, "X-OpenAlice-Step": str(len(records))}
                record = stream_call(client, target, messages, conversation.tools, call, headers, key)
            else:
                record = messages_call(client, target, messages, conversation.tools, call, key)
            records.append(record)
            reply: dict[str, Any] = {"role": "assistant", "content": record.content or None}
            tool_calls = [dict(c, id=c["id"] or f"call_{len(records)}_{k}")
                          for k, c in enumerate(record.tool_calls) if _runnable(c)]
            following = conversation.steps[i + 1].kind if i + 1 < len(conversation.steps) else None
            # the workload answers one call, where a tool result follows: a loop sends back only the
            # calls it answers (Anthropic's API refuses a tool_use without its tool_result, OpenAI's a
            # tool call without its tool message)
            tool_calls = tool_calls[-1:] if following == "tool_result" else []
            if not tool_calls and following == "tool_result" and call.expect_tool_call:
                # the loop needs a call to answer: the one the workload expects
                expected = call.expect_tool_call
                tool_calls = [{"id": f"call_{len(records)}_0", "type": "function",
                               "function": {"name": expected["name"], "arguments": json.dumps(expected["arguments"])}}]
            if tool_calls:
                reply["tool_calls"] = tool_calls
                last_call_id = tool_calls[-1]["id"]
            if reply["content"] is None and not tool_calls:
                reply["content"] = ""
            messages.append(reply)
        elif step.kind == "tool_result":
            if last_call_id is None:
                raise LoopError(f"{conversation.id}: steps[{i}] is a tool result but no call was made before it")
            messages.append({"role": "tool", "tool_call_id": last_call_id, "content": step.text})
        else:
            messages.append({"role": "user", "content": step.text})
    return {
        "id": conversation.id,
        "target": target.name,
        "run": run,
        "seconds": round(time.perf_counter() - t0, 4),
        "calls": records,
    }


# ---- the benchmark --------------------------------------------------------------------------
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
                before_run: Callable[[], None] | None = None) -> dict[str, Any]:
    """`before_run`, when given, is called before every timed conversation: targets that share
    servers (a runner in front of a pool beside the pool itself) reset the servers' prefix caches
    there, so no target finds the prompts another one left behind."""
    if warmup < 0:
        raise ValueError(f"warmup must be 0 or more, got {warmup}")
    if not targets:
        raise ValueError("no targets to run")
    if len({t.name for t in targets}) != len(targets):
        raise ValueError("target names must be unique")
    own_client = client is None
    if own_client:
        import httpx

        client = httpx.Client(timeout=httpx.Timeout(600.0, connect=10.0))
    runs: dict[tuple[str, str], list[dict]] = {}
    warmups: dict[str, list[float]] = {}
    try:
        for target in targets:  # first-call costs of a fresh server (lazy loads, allocations) stay out
            target.model = target.model or served_model(client, target)
            warmups[target.name] = [round(r.seconds, 4) for r in warm_up(client, target, conversations, warmup)]
            if progress and warmup:
                progress(f"{target.name}: warm-up calls {warmups[target.name]} s")
        for run, conversation, target in schedule(conversations, targets, repeat):
            if before_run:
                before_run()
            done = run_conversation(client, target, conversation, run)
            runs.setdefault((conversation.id, target.name), []).append(done)
            if progress:
                progress(_run_line(done))
    finally:
        if own_client:
            client.close()
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
    report = {"kept": kept_label(repeat), "warmup_seconds": warmups, "conversations": rows,
              "summary": summarize(rows, [t.name for t in targets])}
    report["summary"]["outputs"] = compare_outputs(runs, [t.name for t in targets])
    report["summary"]["paired_calls"] = paired_calls(runs, [t.name for t in targets])
    report["summary"]["first_token"] = first_token_summary(rows, [t.name for t in targets])
    return report


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


def first_token_summary(rows: list[dict], targets: list[str]) -> dict[str, Any]:
    """Per target, the first calls of conversations and the later ones apart: their time to the first
    token, its parts' sums (where the server reports `speculation.first_token`), the rest (what no part
    covers: HTTP, the policy, thread hops, the scheduler's own work), the prompt tokens not served from
    the cache, and those tokens' rate over the whole time to the first token and over the prefill's
    passes alone (tokens per second)."""
    out: dict[str, Any] = {}
    for name in targets:
        mine = [r for r in rows if r["target"] == name]
        groups = {"first": [r["calls"][0] for r in mine if r["calls"]],
                  "later": [c for r in mine for c in r["calls"][1:]]}
        out[name] = {group: _first_token_sums(calls) for group, calls in groups.items()}
    return out


def _first_token_sums(calls: list[dict]) -> dict[str, Any]:
    ttft_ms = sum(1000 * c["ttft_s"] for c in calls)
    new_tokens = sum((c["prompt_tokens"] or 0) - (c["cached_tokens"] or 0) for c in calls)
    parts: dict[str, float] = {}
    prefill_tokens = reported = 0
    for call in calls:
        breakdown = (call.get("speculation") or {}).get("first_token")
        if not breakdown:
            continue
        reported += 1
        for part, ms in breakdown["parts_ms"].items():
            parts[part] = parts.get(part, 0.0) + ms
        prefill_tokens += sum(tokens for tokens, _ in breakdown["prefill_chunks"])
    covered = sum(parts.values())
    prefill_ms = parts.get("prefill", 0.0)
    return {
        "calls": len(calls),
        "reported": reported,
        "ttft_ms": round(ttft_ms, 1),
        "parts_ms": {part: round(ms, 1) for part, ms in parts.items()},
        "rest_ms": round(ttft_ms - covered, 1) if reported == len(calls) else None,
        "new_prompt_tokens": new_tokens,
        "new_tokens_per_s": round(1000 * new_tokens / ttft_ms, 1) if ttft_ms else None,
        "prefill_tokens_per_s": round(1000 * prefill_tokens / prefill_ms, 1) if prefill_ms else None,
    }


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


def _first_token_table(summary: dict[str, Any]) -> list[str]:
    """The time before the first token by part, ms summed over calls, per target and group."""
    from openalice_runner.first_token import PARTS

    if not any(g["reported"] for t in summary.values() for g in t.values()):
        return []
    lines = ["", "| time to first token, ms summed (calls) | ttft | " + " | ".join(PARTS)
             + " | rest | new tokens | tok/s | prefill tok/s |", "|---|" + "---|" * (len(PARTS) + 5)]
    for target, groups in summary.items():
        for group, g in groups.items():
            cells = [str(g["parts_ms"].get(p, "-")) for p in PARTS]
            lines.append(f"| {target} {group} ({g['calls']}) | {g['ttft_ms']} | " + " | ".join(cells)
                         + f" | {g['rest_ms']} | {g['new_prompt_tokens']} | {g['new_tokens_per_s']} | "
                         f"{g['prefill_tokens_per_s']} |")
    return lines


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
