"""What each new wire's translation costs per call over Chat Completions: the same request sent as
Chat Completions, as Anthropic Messages and as OpenAI Responses to one `serve`, paired call by call.

    python -m openalice_runner.bench.wire_overhead [--workload FILE] [--n 201] [--json report.json]
    python -m openalice_runner.bench.wire_overhead --url http://127.0.0.1:8000 ...   # a running serve

The requests are agent-loop calls (`agent-loops.jsonl`) in the shape Claude Code and Codex send: a
system prompt, the loop's tools, the model's tool call and the tool's result in the history (the
state just before each loop's second model call). Each is written once in each wire (`as_chat`,
`as_messages`, `as_responses`: the same system text, turns, tool definitions and budget). Unless
`--url` names a server, one `serve` is started on loopback on the tiny random model with
`max_tokens` 1 at temperature 0, so the model's share of a call is a single short step on a prompt
its prefix cache holds after the warm-up: what differs between the wires is the server's parse,
translation and reply formatting (and the client reading a different body, which is small).
Each pair sends one request as Chat and as the other wire back to back, the order alternating
pair by pair, the two wires (Messages, Responses) taking turns pair by pair too, so drift on a
shared CPU hits both sides alike. Plain and streamed calls (the whole call, to the stream's end).
Reported per wire and mode: p50/p90 of the paired difference (wire minus chat) in ms, the median
of each side, and how many pairs had the prompt's token count or the reply's text differ (both
should be 0: a translation that changed the prompt would make the model do other work).
Target (issue 45): the difference at most 1 ms p50.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from openalice_runner.bench.loop_targets import free_port
from openalice_runner.bench.loops import Conversation, load_loops
from openalice_runner.bench.wire_bodies import messages_body, responses_body
from openalice_runner.bench.wire_replies import summary
from openalice_runner.providers.base import CallContext, Capabilities, Provider
from openalice_runner.providers.streams import chat_stream
from openalice_runner.types import ChatChunk, ChatRequest, ChatResult, ChunkChoice, Usage, new_id

WORKLOAD = (
    Path(__file__).resolve().parents[3] / "shared" / "workloads" / "agent-loops.jsonl"
)  # beside the checkout
WIRES = ("messages", "responses")
SYSTEM = "You are a coding agent working in the user's workspace. Use the tools when they help."
# the tiny random model (`--server tiny`): a real model, whose time (and its noise) is in every call
TINY_PROVIDERS = """\
providers:
  local: {type: local, tiny_random: true}
routes:
  - {name: default, chain: [local]}
"""
# the default (`--server instant`): the real `serve` whose one provider answers at once (InstantProvider)
INSTANT_PROVIDERS = """\
providers:
  instant: {type: hosted, model: instant/model}
routes:
  - {name: default, chain: [instant]}
"""


# --- the server: `serve` with a provider that answers at once ---------------------------------


class InstantProvider(Provider):
    """Answers one token ("ok") at once, plain or streamed, with no model behind it: a call's time is
    then the server's own (parse, translation, admission, policy, spans, reply formatting). Its
    usage's prompt tokens are the size of the request it was handed (messages and tools as JSON), so
    two wires whose translations hand it different requests show different counts."""

    kind = "hosted"

    def __init__(self, name: str = "instant") -> None:
        self.name = name
        self.capabilities = Capabilities()

    @property
    def model_names(self) -> list[str]:
        return ["instant-model"]

    @staticmethod
    def _usage(request: ChatRequest) -> Usage:
        seen = request.model_dump(mode="json", include={"messages", "tools"}, exclude_none=True)
        return Usage.of(len(json.dumps(seen, sort_keys=True)), 1)

    async def chat(self, request: ChatRequest, ctx: CallContext) -> ChatResult:
        return ChatResult.single(
            model="instant-model",
            content="ok",
            finish_reason="length",
            usage=self._usage(request),
            provider=self.name,
        )

    def stream(self, request: ChatRequest, ctx: CallContext):
        return chat_stream(self._chunks(request))

    async def _chunks(self, request: ChatRequest):
        chunk_id = new_id("chatcmpl")
        yield ChatChunk.text(chunk_id, "instant-model", "ok", role=True)
        yield ChatChunk(
            id=chunk_id,
            model="instant-model",
            choices=[ChunkChoice(finish_reason="length")],
            usage=self._usage(request),
            provider=self.name,
        )


def serve_instant(argv: list[str]) -> int:
    """`openalice-runner serve ARGV` as it is, its providers built as InstantProvider."""
    import openalice_runner.runner as runner_module
    from openalice_runner.cli import main as cli_main

    runner_module.build_provider = lambda name, config, engine=None: InstantProvider(name)
    return cli_main(["serve", *argv])


# --- the requests ------------------------------------------------------------------------------


def agent_request(loop: Conversation) -> dict[str, Any] | None:
    """The chat request just before the loop's second model call: system prompt, opening turns, the
    first call's expected tool call and the tool's result. None when the loop has no such call."""
    messages = [dict(m) for m in loop.messages]
    if not messages or messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": SYSTEM})
    calls, pending = 0, None
    for step in loop.steps:
        if step.kind == "call":
            calls += 1
            if calls == 2:
                break
            expected = step.call.expect_tool_call if step.call else None
            if not expected:
                return None
            pending = f"call_{loop.id.replace('-', '_')}_1"
            messages.append(
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": pending,
                            "type": "function",
                            "function": {
                                "name": expected["name"],
                                "arguments": json.dumps(expected["arguments"]),
                            },
                        }
                    ],
                }
            )
        elif step.kind == "tool_result" and pending:
            messages.append({"role": "tool", "tool_call_id": pending, "content": step.text})
            pending = None
        elif step.kind == "user":
            messages.append({"role": "user", "content": step.text})
    if calls < 2 or not any(m["role"] == "tool" for m in messages):
        return None
    return {"messages": messages, "tools": loop.tools}


def as_chat(req: dict[str, Any], model: str, stream: bool) -> dict[str, Any]:
    body = {"model": model, "messages": req["messages"], "max_tokens": 1, "temperature": 0, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    if req["tools"]:
        body["tools"] = req["tools"]
    return body


def as_messages(req: dict[str, Any], model: str, stream: bool) -> dict[str, Any]:
    """Anthropic Messages, as Claude Code writes it: `system` blocks, tool_use and tool_result blocks."""
    return messages_body(req["messages"], req["tools"], model=model, max_tokens=1, stream=stream)


def as_responses(req: dict[str, Any], model: str, stream: bool) -> dict[str, Any]:
    """OpenAI Responses, as Codex writes it (wire_bodies.responses_body)."""
    return responses_body(req["messages"], req["tools"], model=model, max_tokens=1, stream=stream)


SERVERS = {
    "instant": "serve on loopback, its provider answering one token at once (InstantProvider)",
    "tiny": "serve on loopback on the tiny random model (type local, tiny_random)",
}
BUILD = {"chat": as_chat, "messages": as_messages, "responses": as_responses}
PATH = {"chat": "/v1/chat/completions", "messages": "/v1/messages", "responses": "/v1/responses"}


# --- one call ----------------------------------------------------------------------------------


def _call(client, base: str, wire: str, body: dict[str, Any]) -> tuple[float, bytes]:
    """The whole call's time (to the stream's end when streamed) and the raw reply, parsed later."""
    t0 = time.perf_counter()
    if not body["stream"]:
        response = client.post(base + PATH[wire], json=body)
        raw = response.content
    else:
        with client.stream("POST", base + PATH[wire], json=body) as response:
            raw = response.read()
    elapsed = time.perf_counter() - t0
    if response.status_code != 200:
        raise RuntimeError(f"{wire}: {response.status_code} {raw[:500]!r}")
    return elapsed, raw


# --- the run -----------------------------------------------------------------------------------


def _quantile(xs: list[float], q: int) -> float | None:
    return statistics.quantiles(xs, n=10)[q - 1] if len(xs) > 1 else None


def _ms(x: float | None) -> float | None:
    return None if x is None else round(1000 * x, 3)


def measure(
    base: str, requests: list[dict[str, Any]], n: int, stream: bool, warmup: int = 3
) -> dict[str, Any]:
    """n pairs per wire: pair k sends request k mod len(requests) as chat and as the wire, in
    alternating order; the two wires take turns pair by pair."""
    import httpx

    with httpx.Client(timeout=httpx.Timeout(120.0, connect=10.0)) as client:
        model = client.get(base + "/v1/models").json()["data"][0]["id"]
        bodies = [{w: BUILD[w](r, model, stream) for w in ("chat", *WIRES)} for r in requests]
        for _ in range(warmup):
            for b in bodies:
                for w in ("chat", *WIRES):
                    _call(client, base, w, b[w])
        got: dict[str, dict[str, list]] = {w: {"diff": [], "wire": [], "chat": []} for w in WIRES}
        differ = {w: {"prompt_tokens": 0, "text": 0} for w in WIRES}
        prompt_tokens: dict[str, dict[str, int]] = {w: {} for w in ("chat", *WIRES)}
        for k in range(n * len(WIRES)):
            wire, pair = WIRES[k % len(WIRES)], k // len(WIRES)
            b = bodies[pair % len(bodies)]
            order = ("chat", wire) if pair % 2 == 0 else (wire, "chat")
            res = {w: _call(client, base, w, b[w]) for w in order}
            seen = {w: summary(w, res[w][1], stream) for w in order}
            differ[wire]["prompt_tokens"] += seen[wire][0] != seen["chat"][0]
            differ[wire]["text"] += seen[wire][1] != seen["chat"][1]
            for w in order:
                prompt_tokens[w].setdefault(str(pair % len(bodies)), seen[w][0])
            got[wire]["diff"].append(res[wire][0] - res["chat"][0])
            got[wire]["wire"].append(res[wire][0])
            got[wire]["chat"].append(res["chat"][0])
    report: dict[str, Any] = {
        "stream": stream,
        "pairs_per_wire": n,
        "requests": len(bodies),
        "prompt_tokens_by_request": prompt_tokens,
        "wires": {},
    }
    for w in WIRES:
        d = got[w]
        report["wires"][w] = {
            "pairs": len(d["diff"]),
            "overhead_p50_ms": _ms(statistics.median(d["diff"])),
            "overhead_p90_ms": _ms(_quantile(d["diff"], 9)),
            "wire_p50_ms": _ms(statistics.median(d["wire"])),
            "chat_p50_ms": _ms(statistics.median(d["chat"])),
            "prompt_tokens_differed": differ[w]["prompt_tokens"],
            "text_differed": differ[w]["text"],
        }
    return report


@contextlib.contextmanager
def serve(server: str = "instant", startup_s: float = 300.0, log=print):
    """One `serve` on loopback (`instant`: its provider answers at once; `tiny`: the tiny random
    model); yields its base URL (without /v1)."""
    import httpx

    with tempfile.TemporaryDirectory(prefix="bench-wires-") as tmp:
        providers = Path(tmp) / "providers.yaml"
        providers.write_text(INSTANT_PROVIDERS if server == "instant" else TINY_PROVIDERS)
        port = free_port()
        log_path = Path(tmp) / "serve.log"
        head = (
            [sys.executable, "-m", "openalice_runner.bench.wire_overhead", "serve-instant"]
            if server == "instant"
            else [sys.executable, "-m", "openalice_runner", "serve"]
        )
        command = head + [
            "--log-level",
            "warning",
            "--providers",
            str(providers),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ]
        with open(log_path, "wb") as log_file:
            proc = subprocess.Popen(
                command, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
        try:
            deadline = time.monotonic() + startup_s
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(
                        f"serve exited with {proc.returncode}:\n{log_path.read_text()[-2000:]}"
                    )
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                        break
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"serve not ready after {startup_s:.0f} s:\n{log_path.read_text()[-2000:]}"
                    )
                time.sleep(0.25)
            log(f"serve ({server}): ready on port {port}")
            yield f"http://127.0.0.1:{port}"
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def run(
    workload: Path, n: int, modes: list[bool], url: str | None = None, server: str = "instant", log=print
) -> dict[str, Any]:
    requests = [r for r in (agent_request(c) for c in load_loops(workload)) if r]
    if not requests:
        raise ValueError(f"{workload}: no loop has a tool call answered before its second model call")
    t0 = time.perf_counter()
    with contextlib.nullcontext(url) if url else serve(server, log=log) as base:
        results = {
            ("streamed" if s else "plain"): measure(base.rstrip("/").removesuffix("/v1"), requests, n, s)
            for s in modes
        }
    return {
        "workload": str(workload),
        "server": url or SERVERS[server],
        "max_tokens": 1,
        "modes": results,
        "seconds": round(time.perf_counter() - t0, 1),
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve-instant"]:  # the child process `serve` runs in
        return serve_instant(argv[1:])
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workload", type=Path, default=WORKLOAD, help="agent-loops JSON lines")
    parser.add_argument("--n", type=int, default=201, help="pairs per wire and mode (default 201)")
    parser.add_argument("--mode", choices=("plain", "streamed", "both"), default="both")
    parser.add_argument(
        "--server",
        choices=tuple(SERVERS),
        default="instant",
        help="the serve started: instant (default: no model time) or tiny (the tiny random model)",
    )
    parser.add_argument("--url", help="a running serve's base URL instead of starting one")
    parser.add_argument("--json", type=Path, help="also write the report here")
    args = parser.parse_args(argv)
    if args.n < 1:
        parser.error("--n must be 1 or more")
    modes = {"plain": [False], "streamed": [True], "both": [False, True]}[args.mode]
    report = run(args.workload, args.n, modes, args.url, args.server, log=lambda s: print(s, file=sys.stderr))
    text = json.dumps(report, indent=2)
    if args.json:
        args.json.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
