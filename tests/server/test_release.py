"""`serve --stream-release` through `serve` on all three wires (issue 48, Build 1): the text and tool
calls of fixed:N and paced equal pass mode's for the same request, N tokens a write, every write of a
padded stream a size bucket (the deltas' writes all the same size), the final usage unchanged, the
real SDKs' parsers reading the padded streams, and a paced stream that still ends at its deadline and
when its client leaves. tests/server/test_release_units.py has the clock and the token rule."""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import threading

import anthropic
import httpx
import openai
import pytest
from stand_ins.engines import tiny_engine
from stand_ins.scripted import ScriptedProvider, scripted_runner
from support.live_server import LiveServer

from openalice_runner.providers.config import load_routing_text
from openalice_runner.runner import Runner
from openalice_runner.server.app import ServerSettings, create_app
from openalice_runner.server.release.modes import parse_release
from openalice_runner.server.release.padding import bucket
from openalice_runner.server.release.units import cut
from openalice_runner.types import ChatChunk
from server.test_release_units import clock_rates_used, final, script

MODES = ["pass", "fixed:1", "fixed:3", "fixed:8", "paced"]
TOOLS = [{"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}
         for name in ("get_weather", "get_time")]  # fmt: skip


class Passes(ScriptedProvider):
    """Streams tests/server/test_release_units.py's script: passes of 1 to 5 tokens, a word cut across
    passes, two tool calls cut mid-argument, the last chunk with usage and speculation."""

    def __init__(self) -> None:
        super().__init__(model="passes-model")

    async def _chunks(self, request, ctx):
        self.calls.append((request, ctx))
        for chunk in script():
            await asyncio.sleep(0)  # each pass its own step of the loop, as a real stream's
            yield chunk.model_copy(update={"model": self.model})


class Stalls(ScriptedProvider):
    """A long pass, a short one, then nothing until cancelled: `closed` is set when its stream ends."""

    def __init__(self) -> None:
        super().__init__(model="stalls-model")
        self.closed = threading.Event()

    async def _chunks(self, request, ctx):
        try:
            yield ChatChunk.text("chatcmpl-s", self.model, " ".join(f"word{'abcdefghijklmnopqrst'[i]}" for i in range(20)),
                                 role=True)  # fmt: skip
            await asyncio.sleep(0.5)  # the clock's rate: 2 tokens a second, 10 s for the first pass
            yield ChatChunk.text("chatcmpl-s", self.model, " more")
            await asyncio.Event().wait()
        finally:
            self.closed.set()


@pytest.fixture(scope="module")
def scripted():
    runner = scripted_runner(Passes())
    settings = ServerSettings()
    live = LiveServer(create_app(runner, settings=settings)).start()
    live.settings, live.model = settings, "passes-model"
    yield live
    live.stop()


ENGINE_PROVIDERS = """
providers:
  local: {type: local, tiny_random: true, max_tokens_default: 48}
routes:
  - {name: default, chain: [local]}
"""
NGRAM = "version: 1\nname: ngram\ndefault:\n  method: ngram\n  gamma: 3\n"
PROMPT = "one two three one two three one two three one two"
ENGINE_PROMPT = "a b c d e f g"  # the tiny random model answers newlines, then words


@pytest.fixture(scope="module")
def engine_served(tmp_path_factory):
    policy = tmp_path_factory.mktemp("policy") / "ngram.yaml"
    policy.write_text(NGRAM)
    runner = Runner.from_config(providers=load_routing_text(ENGINE_PROVIDERS), policy=str(policy), engine=tiny_engine())
    settings = ServerSettings()
    live = LiveServer(create_app(runner, settings=settings)).start()
    live.settings, live.model = settings, runner.model_names()[0]
    yield live
    live.stop()


# ---------------------------------------------------------------- reading a stream as a client would


def _body(wire: str, model: str, tools: bool, prompt: str = PROMPT) -> tuple[str, dict]:
    messages = [{"role": "user", "content": prompt}]
    if wire == "chat":
        body = {"model": model, "messages": messages, "max_tokens": 48, "stream": True,
                "stream_options": {"include_usage": True}, "temperature": 0}  # fmt: skip
        if tools:
            body["tools"] = TOOLS
        return "/v1/chat/completions", body
    if wire == "messages":
        body = {"model": model, "max_tokens": 48, "stream": True, "messages": messages, "temperature": 0}
        if tools:
            body["tools"] = [{"name": t["function"]["name"], "input_schema": {"type": "object"}} for t in TOOLS]
        return "/v1/messages", body
    body = {"model": model, "max_output_tokens": 48, "stream": True, "input": prompt, "temperature": 0}
    if tools:
        body["tools"] = [{"type": "function", "name": t["function"]["name"], "parameters": {"type": "object"}}
                         for t in TOOLS]  # fmt: skip
    return "/v1/responses", body


def _events(data: bytes) -> list[tuple[str | None, dict | str]]:
    """SSE events as the standard reads them (comment lines ignored): (event name, parsed data)."""
    out = []
    for block in data.decode().split("\n\n"):
        name, lines = None, []
        for line in block.split("\n"):
            if not line or line.startswith(":"):
                continue
            field, _, value = line.partition(":")
            value = value.removeprefix(" ")
            if field == "event":
                name = value
            elif field == "data":
                lines.append(value)
        if lines:
            text = "\n".join(lines)
            out.append((name, text if text == "[DONE]" else json.loads(text)))
    return out


class Read:
    """One stream as a client reads it: its writes (padded streams: each begins with its comment
    line), and per write its pieces: ("text", s), ("open", call, name), ("args", call, s)."""

    def __init__(self, wire: str, body: bytes, padded: bool) -> None:
        self.wire, self.body, self.padded = wire, body, padded
        if padded:
            starts = [m.start() for m in re.finditer(rb"(?m)^:[ ]*\n", body)]
            assert starts and starts[0] == 0, body[:200]
            self.writes = [body[a:b] for a, b in zip(starts, [*starts[1:], len(body)], strict=True)]
        else:
            self.writes = [body]
        self.pieces: list[list[tuple]] = []
        self.kinds: list[set[str]] = []  # the event types in each write
        self.usage = None
        for write in self.writes:
            pieces, kinds = [], set()
            for name, data in _events(write):
                kinds.add(self._read(name, data, pieces))
            self.pieces.append(pieces)
            self.kinds.append(kinds)

    def _read(self, name, data, pieces) -> str:
        """The event's pieces into `pieces`; returns its kind ("delta": a text or arguments piece alone)."""
        return {"chat": self._chat, "messages": self._messages, "responses": self._responses}[self.wire](data, pieces)

    def _chat(self, data, pieces) -> str:
        if data == "[DONE]":
            return "done"
        if data.get("usage"):
            self.usage = data["usage"]
        for choice in data["choices"]:
            delta = choice["delta"]
            if delta.get("content"):
                pieces.append(("text", delta["content"]))
            for call in delta.get("tool_calls") or ():
                if call.get("id"):
                    pieces.append(("open", call["index"], call["function"]["name"]))
                if call["function"].get("arguments"):
                    pieces.append(("args", call["index"], call["function"]["arguments"]))
        return "delta" if data["choices"] and not data["choices"][0].get("finish_reason") else "end"

    def _messages(self, data, pieces) -> str:
        kind = data["type"]
        if kind == "content_block_start" and data["content_block"]["type"] == "tool_use":
            pieces.append(("open", data["index"], data["content_block"]["name"]))
        elif kind == "content_block_delta" and data["delta"]["type"] == "text_delta":
            pieces.append(("text", data["delta"]["text"]))
        elif kind == "content_block_delta":
            pieces.append(("args", data["index"], data["delta"]["partial_json"]))
        elif kind == "message_delta":
            self.usage = data["usage"]
        return "delta" if kind == "content_block_delta" else kind

    def _responses(self, data, pieces) -> str:
        kind = data["type"]
        if kind == "response.output_item.added" and data["item"]["type"] == "function_call":
            pieces.append(("open", data["output_index"], data["item"]["name"]))
        elif kind == "response.output_text.delta":
            pieces.append(("text", data["delta"]))
        elif kind == "response.function_call_arguments.delta":
            pieces.append(("args", data["output_index"], data["delta"]))
        elif kind in ("response.completed", "response.incomplete"):
            self.usage = data["response"]["usage"]
        return "delta" if kind.endswith(".delta") else kind

    @property
    def text(self) -> str:
        return "".join(p[1] for write in self.pieces for p in write if p[0] == "text")

    @property
    def calls(self) -> list[tuple[str, str]]:
        calls: dict = {}
        for write in self.pieces:
            for piece in write:
                if piece[0] == "open":
                    calls[piece[1]] = [piece[2], ""]
                elif piece[0] == "args":
                    calls[piece[1]][1] += piece[2]
        return [tuple(calls[k]) for k in sorted(calls)]

    def units(self) -> list[int]:
        """Tokens in each write that carries any: openings count one; text and arguments by where the
        units of the whole content (of each call's whole arguments) end, as units.py cuts them. A
        padded stream's pieces each end where a unit ends."""
        wholes: dict = {}
        for write in self.pieces:
            for piece in write:
                if piece[0] != "open":
                    wholes[piece[:-1]] = wholes.get(piece[:-1], "") + piece[-1]
        ends = {key: set(itertools.accumulate(len(unit) for unit in cut(whole))) for key, whole in wholes.items()}
        at: dict = dict.fromkeys(wholes, 0)
        counts = []
        for write in self.pieces:
            count = 0
            for piece in write:
                if piece[0] == "open":
                    count += 1
                    continue
                key, start = piece[:-1], at[piece[:-1]]
                at[key] = stop = start + len(piece[-1])
                assert self.padded is False or stop in ends[key], (piece, "ends inside a unit")
                count += sum(1 for end in ends[key] if start < end <= stop)
            counts.append(count)
        return [c for c in counts if c]


def _stream(live, wire: str, mode: str, *, tools: bool = False, prompt: str = PROMPT) -> Read:
    live.settings.stream_release = parse_release(mode)
    path, body = _body(wire, live.model, tools, prompt)
    reply = httpx.post(live.url + path, json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    return Read(wire, reply.content, padded=mode != "pass")


def _check_padding(read: Read) -> None:
    sizes = [len(write) for write in read.writes]
    assert all(size == bucket(size) for size in sizes), sizes
    deltas = {len(w) for w, kinds in zip(read.writes, read.kinds, strict=True) if kinds == {"delta"}}
    assert deltas == {1024} or (not deltas and len(read.units()) < 3), sizes  # deltas' writes all the same


WIRES = ["chat", "messages", "responses"]


@pytest.mark.parametrize("mode", MODES[1:])
@pytest.mark.parametrize("wire", WIRES)
def test_scripted_passes_leave_whole_in_each_mode(scripted, wire, mode):
    """Text and both tool calls as pass mode gives them; fixed:N writes hold N tokens but the last;
    every write a bucket; the usage unchanged."""
    control = _stream(scripted, wire, "pass", tools=True)
    content = "".join(c.delta_text for c in script())
    assert control.text == content and [name for name, _ in control.calls] == ["get_weather", "get_time"]
    read = _stream(scripted, wire, mode, tools=True)
    assert (read.text, read.calls) == (control.text, control.calls)
    assert read.usage == control.usage and read.usage  # the final usage unchanged
    counts = read.units()
    whole = len(cut(content)) + sum(1 + len(cut(args)) for _, args in control.calls)
    assert sum(counts) == whole  # every token once
    if mode.startswith("fixed:"):
        n = int(mode.removeprefix("fixed:"))
        assert all(c == n for c in counts[:-1]) and 0 < counts[-1] <= n, counts
    else:
        assert max(counts) <= whole
    _check_padding(read)
    assert len(control.writes) == 1  # pass mode: nothing padded (one body, no comment lines)
    assert b"\n:" not in control.body and not control.body.startswith(b":")


@pytest.mark.parametrize("mode", MODES[1:])
@pytest.mark.parametrize("wire", WIRES)
def test_engine_greedy_reply_is_the_same_in_each_mode(engine_served, wire, mode):
    """The embedded engine, greedy with n-gram speculation (several tokens a pass): the same text and
    usage in every mode; fixed:N's writes hold N tokens but the last."""
    control = _stream(engine_served, wire, "pass", prompt=ENGINE_PROMPT)
    read = _stream(engine_served, wire, mode, prompt=ENGINE_PROMPT)
    assert read.text == control.text and read.text
    assert read.usage == control.usage
    counts = read.units()
    assert sum(counts) == len(cut(control.text)) >= 10  # a reply of several writes
    if mode.startswith("fixed:"):
        n = int(mode.removeprefix("fixed:"))
        assert all(c == n for c in counts[:-1]) and 0 < counts[-1] <= n, counts
    _check_padding(read)


# ---------------------------------------------------------------- the SDKs read padded streams


def _sdk_replies(live) -> tuple:
    base = live.url + "/v1"
    oa = openai.OpenAI(base_url=base, api_key="k", max_retries=0, timeout=60)
    messages = [{"role": "user", "content": PROMPT}]
    text, calls = "", {}
    for chunk in oa.chat.completions.create(model=live.model, messages=messages, tools=TOOLS, stream=True):
        for choice in chunk.choices:
            text += choice.delta.content or ""
            for call in choice.delta.tool_calls or ():
                entry = calls.setdefault(call.index, ["", ""])
                entry[0] += call.function.name or ""
                entry[1] += call.function.arguments or ""
    chat = (text, sorted(calls.values()))
    events = list(oa.responses.create(model=live.model, input=PROMPT, stream=True,
                                      tools=[{"type": "function", "name": "get_weather", "parameters": {}}]))  # fmt: skip
    done = events[-1].response
    responses = (done.output_text, [(item.name, item.arguments) for item in done.output if item.type == "function_call"])
    client = anthropic.Anthropic(base_url=live.url, api_key="k", max_retries=0, timeout=60)
    with client.messages.stream(model=live.model, max_tokens=64, messages=messages) as stream:
        message = stream.get_final_message()
    msgs = ("".join(b.text for b in message.content if b.type == "text"),
            [(b.name, b.input) for b in message.content if b.type == "tool_use"], message.usage.output_tokens)  # fmt: skip
    return chat, responses, msgs


@pytest.mark.parametrize("mode", ["fixed:3", "paced", "fixed:3+pad", "paced+pad"])
def test_the_openai_and_anthropic_sdks_read_padded_streams_as_pass_mode(scripted, mode):
    """(The +pad modes: the second and third streams are clocked and end with filler writes.)"""
    scripted.settings.stream_release = parse_release("pass")
    control = _sdk_replies(scripted)
    assert control[0][0] and control[0][1] and control[2][1]  # text and calls to compare
    scripted.settings.stream_release = parse_release(mode)
    assert _sdk_replies(scripted) == control
    assert final().usage.completion_tokens == control[2][2]


def test_a_tenants_turn_types_each_have_their_own_clock(scripted, monkeypatch):
    """A clocked stream starts from its tenant's recent streams of its own turn type: a chat turn after
    fast copy-heavy ones is not held to their clock, which it could not keep (its stalls then told its
    text: docs/benchmarks/2026-12-05-side-channel-4.md). The first stream of each turn type leaves as
    produced; the second of each is clocked."""
    from openalice_runner.server.release import stream as stream_module

    used = clock_rates_used(monkeypatch)
    scripted.settings.stream_release = parse_release("fixed:3")
    unheld = stream_module.UNHELD_RATE

    def stream(turn_type: str) -> float:
        """The rate the stream of this turn type was clocked at."""
        body = {"model": scripted.model, "messages": [{"role": "user", "content": PROMPT}], "stream": True}
        reply = httpx.post(scripted.url + "/v1/chat/completions", json=body, timeout=60,
                           headers={"X-OpenAlice-Turn-Type": turn_type})
        assert reply.status_code == 200 and b"[DONE]" in reply.content
        return used[-1]

    # until the copy turns have a clock (a stream too quick to time records no rate)
    assert any(stream("clock-copy") < unheld for _ in range(5)), used
    assert stream("clock-chat") == unheld, used
    assert any(stream("clock-chat") < unheld for _ in range(5)), used


# ---------------------------------------------------------------- deadlines and clients that leave


@pytest.fixture()
def stalls():
    provider = Stalls()
    settings = ServerSettings(stream_release="paced")
    live = LiveServer(create_app(scripted_runner(provider), settings=settings)).start()
    live.provider = provider
    yield live
    live.stop()


def test_a_paced_stream_ends_at_its_deadline_while_its_clock_waits(stalls):
    """20 tokens at 2 a second to send, then an upstream that never answers: the request's deadline
    (1 s) ends the stream with its error event, padded, and the provider's stream is closed."""
    body = {"model": "stalls-model", "messages": [{"role": "user", "content": "hi"}], "stream": True, "timeout": 1}
    reply = httpx.post(stalls.url + "/v1/chat/completions", json=body, timeout=60)
    writes = [m.start() for m in re.finditer(rb"(?m)^:[ ]*\n", reply.content)]
    last = _events(reply.content[writes[-1]:])[-1][1]
    assert last["error"]["code"] == "deadline_exceeded"
    assert 0 < len(_events(reply.content)) - 1 < 20  # some tokens left on the clock before it
    assert len(reply.content) - writes[-1] == 1024  # the error event padded as well
    assert stalls.provider.closed.wait(30)


def test_a_paced_stream_stops_when_its_client_leaves(stalls):
    body = {"model": "stalls-model", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    with httpx.stream("POST", stalls.url + "/v1/chat/completions", json=body, timeout=60) as reply:
        first = next(reply.iter_raw())
        assert first.startswith(b":")
    assert stalls.provider.closed.wait(30)  # the client left on the clock: the generation stopped


# ---------------------------------------------------------------- pool streams, re-chunked at the runner


@pytest.fixture(scope="module", params=["stream", "tool_call_stream"])
def pool_served(request):
    """A vLLM pool whose replica answers with vLLM 0.32's recorded n-gram streams (several tokens a
    chunk): its chunks are re-chunked at the runner as the engine's are."""
    from providers.test_vllm import Replay

    from openalice_runner.providers.config import load_routing_text as routing_text
    from openalice_runner.providers.pools.vllm.provider import VLLMConfig, VLLMProvider

    answer = request.param.removesuffix("_stream") if request.param != "stream" else "plain"
    pool = {"type": "vllm", "model": "smollm2", "pools": {"ngram": {"replicas": ["http://replica"]}}}
    provider = VLLMProvider("cpu", VLLMConfig.model_validate(pool),
                            client=httpx.AsyncClient(transport=httpx.MockTransport(Replay(answer))))  # fmt: skip
    routing = routing_text("providers:\n  cpu: {type: vllm, model: smollm2, pools: {ngram: {replicas: [http://replica]}}}\n"
                           "routes:\n  - {name: default, chain: [cpu]}\n")  # fmt: skip
    settings = ServerSettings()
    live = LiveServer(create_app(Runner(routing, {"cpu": provider}), settings=settings)).start()
    live.settings, live.model, live.tools = settings, "smollm2", request.param == "tool_call_stream"
    yield live
    live.stop()


@pytest.mark.parametrize("mode", ["fixed:2", "paced"])
@pytest.mark.parametrize("wire", WIRES)
def test_a_pool_stream_leaves_as_pass_mode_gives_it(pool_served, wire, mode):
    control = _stream(pool_served, wire, "pass", tools=pool_served.tools)
    read = _stream(pool_served, wire, mode, tools=pool_served.tools)
    assert (read.text, read.calls) == (control.text, control.calls) and (control.text or control.calls)
    assert read.usage == control.usage  # the tool-call recording has no usage chunk: unknown in both
    assert read.usage or pool_served.tools
    counts = read.units()
    if mode == "fixed:2":
        assert all(c == 2 for c in counts[:-1]) and 0 < counts[-1] <= 2, counts
    else:
        assert max(counts) <= 2 or len(counts) > 1, counts
    _check_padding(read)
