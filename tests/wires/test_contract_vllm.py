"""Contract tier: the runner's /v1/messages and /v1/responses against vLLM 0.32 CPU's own, field for field.

One real vLLM server (the `plain` pool of providers/vllm-cpu.yaml, as the live tier starts it) and
the runner's `serve` routed to it as a `type: vllm` pool, so both answer from the same model. Each
request below goes, unchanged, to vLLM's route and to the runner's; the replies are reduced to their
structure (keys and value types; the values of `type`, `role`, `status`, `stop_reason`, `object`,
`reason`; id prefixes; streams as the sequence of event types with runs of deltas collapsed, each
event's payload reduced alike) and compared. Every difference must match a row of KNOWN below (where
the runner deliberately follows Anthropic's or OpenAI's published contract instead of vLLM); any other
difference fails. The live test is skipped, saying why, only where the side venv is not usable (and
fails under CI=true); the comparator's own checks at the end run everywhere.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import vllm_servers
import yaml
from locations import REPO
from stand_ins.processes import free_port, wait_http
from tiers import needs_install

LIVE = [pytest.mark.slow, needs_install(vllm_servers.venv_problem())]  # the live test's tier marks

POLICY = REPO / "policies" / "vllm-cpu-split.yaml"

PROMPT = "Tell me about the sea in two sentences."
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
          "additionalProperties": False}  # fmt: skip
# strict: vLLM pins a forced call's arguments to the schema only for a strict tool (its
# --tool-strict-level auto); a loose one lets SmolLM2 fill the envelope with any JSON (it copies the
# schema until the budget cuts it: a text block holding `<tool_call>...`, stop max_tokens, on both).
MESSAGES_TOOLS = [{"name": "get_weather", "description": "Current weather for a city", "strict": True,
                   "input_schema": SCHEMA}]  # fmt: skip
RESPONSES_TOOLS = [{"type": "function", "name": "get_weather", "description": "Current weather for a city",
                    "strict": True, "parameters": SCHEMA}]  # fmt: skip

# name -> body; each is sent plain and with stream: true. temperature 0 so both sides decode alike.
MESSAGES = {
    "text": {"model": "smollm2", "max_tokens": 60, "temperature": 0, "messages": [{"role": "user", "content": PROMPT}]},
    "max_tokens": {"model": "smollm2", "max_tokens": 5, "temperature": 0,
                   "messages": [{"role": "user", "content": PROMPT}]},
    "forced_tool": {"model": "smollm2", "max_tokens": 60, "temperature": 0, "tools": MESSAGES_TOOLS,
                    "tool_choice": {"type": "tool", "name": "get_weather"},
                    "messages": [{"role": "user", "content": "Weather in Rome?"}]},
}  # fmt: skip
RESPONSES = {
    "text": {"model": "smollm2", "max_output_tokens": 60, "temperature": 0, "input": PROMPT},
    "max_tokens": {"model": "smollm2", "max_output_tokens": 5, "temperature": 0, "input": PROMPT},
    "forced_tool": {"model": "smollm2", "max_output_tokens": 60, "temperature": 0, "input": "Weather in Rome?",
                    "tools": RESPONSES_TOOLS, "tool_choice": {"type": "function", "name": "get_weather"}},
}  # fmt: skip


@dataclass(frozen=True)
class Known:
    """A difference the runner makes on purpose: `path` (fnmatch over the dotted path, `[]` for any
    list index, `@event` for a stream event's payload), `kind`, and why."""

    wire: str
    path: str
    kind: str  # only_vllm | only_runner | type | value | length | events
    why: str
    detail: str = ".*"  # a regex the difference's detail must match in full


def on_response(key: str, kind: str, why: str) -> list[Known]:
    """A Responses row for a key of the response object: in the plain reply and in every stream event."""
    return [Known("responses", key, kind, why), Known("responses", f"@*.response.{key}", kind, why)]


R = "responses"
ID_MSG = "vLLM 'id:chatcmpl-' / runner 'id:msg_'"
# What each row allows, and why the runner's side is right: Anthropic's Messages API reference and
# streaming docs; OpenAI's Responses API reference and the `openai` SDK's types (3.60,
# openai/types/responses/), which is what Codex and the AI SDK parse. Paths starting `*` match the
# plain reply and the response object inside every stream event alike.
KNOWN = [
    # --- Anthropic Messages ---
    Known(
        "messages",
        "id",
        "value",
        "Anthropic's message ids are msg_...; vLLM reuses its chat completion's chatcmpl-...",
        detail=ID_MSG,
    ),
    Known("messages", "@message_start.message.id", "value", "as above, in the stream", detail=ID_MSG),
    Known(
        "messages",
        "stop_sequence",
        "only_runner",
        "Anthropic's Message always carries stop_sequence (null unless a stop sequence matched); vLLM's plain reply omits it",
    ),
    Known(
        "messages", "speculation", "only_runner", "the runner's documented extra key (docs/agent-runtimes.md)"
    ),
    Known("messages", "@message_delta.speculation", "only_runner", "as above, on the stream's message_delta"),
    Known("messages", "provider", "only_runner", "the runner's documented extra key"),
    Known(
        "messages",
        "events",
        "events",
        "Anthropic's stream sends `ping` after message_start (its streaming docs); vLLM sends none",
    ),
    Known(
        "messages",
        "content",
        "length",
        "an empty completion is `content: []` for the runner (Anthropic's shape for no output); vLLM sends one empty text block",
        detail=r"vLLM 1 \[\{'type': 'text', 'text': 'empty-str'\}\] / runner 0 \[\]",
    ),
    # (message_start's usage.input_tokens: vLLM counts the prompt there, the runner says 0 and gives the
    # count in message_delta, as documented; both are ints, so the structure is the same.)
    # --- OpenAI Responses ---
    Known(
        R,
        "events",
        "events",
        "OpenAI ends a budget-cut stream with `response.incomplete`; vLLM sends `response.completed` with status incomplete",
    ),
    *on_response("speculation", "only_runner", "the runner's documented extra key"),
    *on_response("provider", "only_runner", "the runner's documented extra key"),
    # Response fields OpenAI's Response object has and vLLM 0.32 leaves out:
    *(
        row
        for k in ("completed_at", "safety_identifier", "prompt_cache_key", "store", "error")
        for row in on_response(
            k, "only_runner", "a field of OpenAI's Response object (SDK types); vLLM omits it"
        )
    ),
    # vLLM's own extensions, not in OpenAI's Response object or its usage:
    *(
        row
        for k in (
            "presence_penalty",
            "frequency_penalty",
            "kv_transfer_params",
            "ec_transfer_params",
            "input_messages",
            "output_messages",
            "usage.input_tokens_details.input_tokens_per_turn",
            "usage.input_tokens_details.cached_tokens_per_turn",
            "usage.output_tokens_details.tool_output_tokens",
            "usage.output_tokens_details.tool_output_tokens_per_turn",
            "usage.output_tokens_details.output_tokens_per_turn",
        )
        for row in on_response(
            k, "only_vllm", "a vLLM extension, not in OpenAI's Response object or its usage"
        )
    ),
    *on_response(
        "prompt",
        "only_vllm",
        "OpenAI's optional prompt-template echo (null when none); the runner rejects `prompt` (400)",
    ),
    # Optional fields of newer OpenAI item types that vLLM echoes as null and the runner leaves out
    # (the SDK defaults each to None): message `phase`; function_call `async`, `caller`, and `namespace`
    # (the runner sends namespace only for a namespaced function, docs/agent-runtimes.md); a function
    # tool's `async`, `allowed_callers`, `output_schema`, `defer_loading`.
    *(
        Known(R, f"*{k}", "only_vllm", "optional in OpenAI's SDK types, null here; the runner omits it")
        for k in (
            "phase",
            "item.async",
            "item.caller",
            "item.namespace",
            "output[].async",
            "output[].caller",
            "output[].namespace",
            "tools[].async",
            "tools[].allowed_callers",
            "tools[].output_schema",
            "tools[].defer_loading",
        )
    ),
    Known(
        R,
        "@response.function_call_arguments.done.name",
        "only_vllm",
        "not a field of the SDK's ResponseFunctionCallArgumentsDoneEvent; the call's name is in output_item.added/.done",
    ),
    # Request settings echoed: OpenAI echoes the effective setting; vLLM echoes null.
    *on_response(
        "reasoning",
        "value",
        "OpenAI echoes `reasoning: {effort, summary}` (null members); vLLM null",
    ),
    *on_response("text", "value", "OpenAI echoes `text: {format: {type: text}}` by default; vLLM null"),
    *on_response("top_logprobs", "type", "OpenAI echoes top_logprobs 0 when none were asked for; vLLM null"),
    *on_response("metadata", "value", "OpenAI's metadata is a map, {} when none was sent; vLLM null"),
    Known(
        R,
        "*content[].logprobs",
        "value",
        "output_text.logprobs: the runner sends [] throughout; vLLM [] in the added events, null in the done ones",
    ),
    Known(R, "*part.logprobs", "value", "as above, in response.content_part.done"),
    Known(
        R,
        "*output[].status",
        "value",
        "a message cut by max_output_tokens is an `incomplete` item (OpenAI's item status); vLLM marks it completed",
    ),
    Known(R, "@response.output_item.done.item.status", "value", "as above, in the stream"),
]


def shape(value, key: str | None = None):
    """The structure of a JSON value: literal where the value is part of the contract, else its type."""
    if isinstance(value, dict):
        return {k: shape(v, k) for k, v in value.items()}
    if isinstance(value, list):
        return [shape(v) for v in value]
    if key in ("type", "role", "status", "stop_reason", "object", "reason"):
        return value
    if key == "text" and value == "":
        return "empty-str"  # an empty completion is a contract case of its own (see KNOWN)
    if key in ("id", "call_id", "item_id") and isinstance(value, str):
        m = re.match(r"[A-Za-z]+[_-]", value)
        return f"id:{m.group(0) if m else ''}"
    return type(value).__name__


def differences(vllm, runner, path: str = "") -> list[tuple[str, str, str]]:
    """(path, kind, detail) for every place the two shapes differ."""
    if isinstance(vllm, dict) and isinstance(runner, dict):
        out = []
        for k in vllm.keys() | runner.keys():
            p = f"{path}.{k}" if path else k
            if k not in runner:
                out.append((p, "only_vllm", repr(vllm[k])[:120]))
            elif k not in vllm:
                out.append((p, "only_runner", repr(runner[k])[:120]))
            else:
                out += differences(vllm[k], runner[k], p)
        return out
    if isinstance(vllm, list) and isinstance(runner, list):
        if len(vllm) != len(runner):
            return [
                (path, "length", f"vLLM {len(vllm)} {vllm!r:.200} / runner {len(runner)} {runner!r:.200}")
            ]
        return [d for a, b in zip(vllm, runner, strict=True) for d in differences(a, b, f"{path}[]")]
    if vllm == runner:
        return []
    literal = not (isinstance(vllm, str) and vllm in TYPE_NAMES) or not (
        isinstance(runner, str) and runner in TYPE_NAMES
    )
    return [(path, "value" if literal else "type", f"vLLM {vllm!r} / runner {runner!r}")]


TYPE_NAMES = {"str", "int", "float", "bool", "NoneType"}


def collapse(events: list[dict]) -> list[dict]:
    """Runs of the same delta event become one (their count depends on tokenisation, not the contract)."""
    out: list[dict] = []
    for e in events:
        if out and "delta" in e["type"] and out[-1]["type"] == e["type"] and e["type"] != "message_delta":
            continue
        out.append(e)
    return out


def sse_events(resp: httpx.Response) -> list[dict]:
    events = []
    for line in resp.iter_lines():
        if line.startswith("data:") and line[5:].strip() != "[DONE]":
            events.append(json.loads(line[5:]))
    return events


def allowed(wire: str, diff: tuple[str, str, str]) -> Known | None:
    path, kind, detail = diff
    for k in KNOWN:
        if (
            k.wire == wire
            and k.kind == kind
            and fnmatch.fnmatchcase(path, k.path)
            and re.fullmatch(k.detail, detail)
        ):
            return k
    return None


class Pair:
    """One vLLM server and the runner's serve in front of it."""

    def __init__(self, tmp: Path) -> None:
        from openalice_runner.policies import PolicyStore
        from openalice_runner.pool_checks import find_pool, vllm_pool_launch
        from openalice_runner.providers.config import load_routing_file

        port = free_port()
        data = yaml.safe_load((REPO / "providers" / "vllm-cpu.yaml").read_text())
        cpu = data["providers"]["cpu"]
        cpu["pools"].pop("ngram")  # one server: the plain pool (speculation off)
        pool = cpu["pools"]["plain"]
        pool["replicas"] = [f"http://127.0.0.1:{port}"]
        pool["launch"].update(model_path=str(vllm_servers.ensure_model_dir()),
                              chat_template=str(vllm_servers.TEMPLATE), max_model_len=2048)  # fmt: skip
        data["providers"].pop("local")  # no fallback: a vLLM fault must show, not be served by the engine
        data["routes"] = [{"name": "default", "chain": ["cpu"]}]
        self.routing = tmp / "providers.yaml"
        self.routing.write_text(yaml.safe_dump(data, sort_keys=False))
        policy = PolicyStore.from_file(POLICY).policy
        args = vllm_pool_launch(
            find_pool(load_routing_file(self.routing), "plain", dialect="vllm"), policy
        ).args
        self.vllm = vllm_servers.VLLMServer(args, name="contract", port=port).start(tmp).wait_ready()
        self.port = free_port()
        self.log = (tmp / f"serve-{self.port}.log").open("wb")
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
        env.pop("OPENALICE_API_KEY", None)
        cmd = [sys.executable, "-m", "openalice_runner", "serve", "--port", str(self.port),
               "--providers", str(self.routing)]  # fmt: skip
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        self.runner = f"http://127.0.0.1:{self.port}"
        wait_http(f"{self.runner}/health", self.proc, timeout=120)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        self.vllm.stop()


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    started = Pair(tmp_path_factory.mktemp("contract"))
    yield started
    started.stop()


def exchange(base: str, route: str, body: dict, stream: bool):
    if not stream:
        r = httpx.post(f"{base}{route}", json=body, timeout=300)
        assert r.status_code == 200, (base, r.text)
        return r.json()
    with httpx.stream("POST", f"{base}{route}", json={**body, "stream": True}, timeout=300) as r:
        assert r.status_code == 200, (base, r.read())
        return sse_events(r)


def sequence_fix(wire: str, vllm: list[dict], runner: list[dict]) -> tuple[list[dict], list[dict], list[str]]:
    """Apply the `events` rows of KNOWN to the event lists, saying which applied."""
    used = []
    if (
        wire == "messages"
        and [e for e in runner if e["type"] == "ping"]
        and not [e for e in vllm if e["type"] == "ping"]
    ):
        runner = [e for e in runner if e["type"] != "ping"]
        used.append("runner's ping dropped (vLLM sends none)")
    if (
        wire == "responses"
        and vllm
        and vllm[-1]["type"] == "response.completed"
        and vllm[-1]["response"]["status"] == "incomplete"
    ):
        vllm = [*vllm[:-1], {**vllm[-1], "type": "response.incomplete"}]
        used.append("vLLM's response.completed with status incomplete read as response.incomplete")
    return vllm, runner, used


def compare(wire: str, vllm, runner, stream: bool) -> tuple[list, list]:
    """(allowed differences with their reasons, unexplained differences)."""
    found: list[tuple[str, str, str]] = []
    if not stream:
        found = differences(shape(vllm), shape(runner))
    else:
        vllm, runner, used = sequence_fix(wire, vllm, runner)
        found += [("events", "events", u) for u in used]
        a, b = collapse(vllm), collapse(runner)
        ta, tb = [e["type"] for e in a], [e["type"] for e in b]
        if ta != tb:
            return [], [("events", "sequence", f"vLLM {ta} / runner {tb}")]
        for ea, eb in zip(a, b, strict=True):
            found += differences(shape(ea), shape(eb), f"@{ea['type']}")
    ok = [(d, k.why) for d in found if (k := allowed(wire, d))]
    bad = [d for d in found if not allowed(wire, d)]
    return ok, bad


CASES = [("messages", "/v1/messages", n, b, s) for n, b in MESSAGES.items() for s in (False, True)] + [
    ("responses", "/v1/responses", n, b, s) for n, b in RESPONSES.items() for s in (False, True)
]


@pytest.mark.parametrize(("wire", "route", "name", "body", "stream"), CASES,
                         ids=[f"{c[0]}-{c[2]}-{'stream' if c[4] else 'plain'}" for c in CASES])  # fmt: skip
@LIVE[0]
@LIVE[1]
def test_same_structure_as_vllm(pair, wire, route, name, body, stream):
    vllm = exchange(pair.vllm.url, route, body, stream)
    runner = exchange(pair.runner, route, body, stream)
    ok, bad = compare(wire, vllm, runner, stream)
    for d, why in ok:
        print(
            f"known difference {wire}/{name}/{'stream' if stream else 'plain'}: {d[0]} ({d[1]}): {d[2]} -- {why}"
        )
    assert not bad, "\n".join(f"{p} ({k}): {detail}" for p, k, detail in bad)


# The comparator itself, on replies of the shapes recorded from vLLM 0.32: any difference not in KNOWN fails.
VLLM_MESSAGE = {"id": "chatcmpl-1", "type": "message", "role": "assistant", "model": "smollm2",
                "content": [{"type": "text", "text": "Hi."}], "stop_reason": "end_turn",
                "usage": {"input_tokens": 3, "output_tokens": 2, "cache_creation_input_tokens": 0,
                          "cache_read_input_tokens": 0}}  # fmt: skip
RUNNER_MESSAGE = {**VLLM_MESSAGE, "id": "msg_1", "stop_sequence": None, "provider": "cpu", "speculation": {}}


def test_known_differences_pass_and_are_named():
    ok, bad = compare("messages", VLLM_MESSAGE, RUNNER_MESSAGE, stream=False)
    assert not bad
    assert {d[0] for d, _ in ok} == {"id", "stop_sequence", "provider", "speculation"}


@pytest.mark.parametrize(
    "change",
    [
        {"stop_reason": "max_tokens"},  # a literal contract value
        {"content": [{"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}]},  # a block type
        {"usage": {"input_tokens": 3, "output_tokens": 2}},  # usage fields missing
        {"id": "resp_1"},  # the id row allows msg_ only
        {"stop_reason": None},  # a stream's message_start value where the reply needs one
        {"content": []},  # the empty-completion row allows [] only against vLLM's one *empty* text block
    ],
)
def test_any_other_difference_fails(change):
    _, bad = compare("messages", VLLM_MESSAGE, {**RUNNER_MESSAGE, **change}, stream=False)
    assert bad


def test_a_different_event_sequence_fails():
    vllm = [{"type": t} for t in ("message_start", "content_block_start", "content_block_delta",
                                  "content_block_stop", "message_delta", "message_stop")]  # fmt: skip
    runner = [vllm[0], {"type": "ping"}, *vllm[1:]]
    assert compare("messages", vllm, runner, stream=True)[1] == []  # ping: a known difference
    assert compare("messages", vllm, runner[:-1], stream=True)[1]  # no message_stop
    assert compare("responses", [{"type": "response.completed", "response": {"status": "completed"}}],
                   [{"type": "response.incomplete", "response": {"status": "completed"}}], stream=True)[1]  # fmt: skip
