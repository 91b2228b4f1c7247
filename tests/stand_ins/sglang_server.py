"""Stand-in SGLang server (SGLang needs a GPU): the HTTP surface the runner uses, field for field.

Imitates SGLang 0.5.23 (read from its wheel): `sglang/srt/entrypoints/http_server.py` (routes),
`openai/protocol.py` (ChatCompletionResponse, ChatCompletionStreamResponse, ToolCall, UsageInfo,
SglExt, SpecTokensDetails, ErrorResponse), `openai/sse_utils.py` (the msgspec-built content chunks),
`openai/serving_chat.py` (what goes where) and `managers/tokenizer_manager.py` (meta_info names):
- POST /v1/chat/completions: ChatCompletionResponse (`id`, `object`, `created`, `model`, `choices`
  [`index`, `message` {`role`, `content`, `reasoning_content`, and `tool_calls` only when there are
  some}, `logprobs`, `finish_reason`, `matched_stop`, and `meta_info` when the request sets
  `return_meta_info`], `usage` {`prompt_tokens`, `total_tokens`, `completion_tokens`,
  `prompt_tokens_details`, `reasoning_tokens`, `completion_tokens_details`}, `metadata`, and `sglext`
  only when something in it is set). Tool calls are parsed out of the text only when the server
  was launched with `--tool-call-parser` (`tool_call_parser` here; without it the call stays text in
  `content`); each carries `id`, `index`, `type`, `function` {`name`, `arguments`}, beside
  `content: ""` (SGLang never sends null content).
  Speculation counters, 0.5.23 names: meta_info `spec_verify_ct`, `spec_accept_rate`,
  `spec_accept_length`, `spec_num_correct_drafts`, `spec_num_proposed_drafts` (= verify_ct ×
  (num_draft_tokens − 1)), `spec_correct_drafts_histogram` (grown to the largest k seen + 1);
  with `return_spec_tokens_details`, the same as `sglext.spec_tokens_details` (SpecTokensDetails,
  every field). `return_meta_info` with `stream` is refused (400), as in SGLang.
- streaming: SSE `data:` events: a role opener (msgspec chunk, delta {`reasoning_content`: null,
  `role`: "assistant", `content`: ""}), content deltas (delta {`reasoning_content`: null, `content`}),
  tool-call deltas (pydantic chunk: delta {`role`, `content`, `reasoning_content`: null,
  `tool_calls` [{`id`, `index`, `type`, `function`}]}, `usage`: null), a finish chunk, then an
  `sglext` chunk (`choices` [], `usage` null, `sglext` {`spec_tokens_details`}) when the request set
  `return_spec_tokens_details` and speculation ran, a usage chunk (`choices` []) when
  `stream_options.include_usage`, and `data: [DONE]`.
- errors: HTTP status with `{"object": "error", "message", "type", "param", "code"}`; in a stream an
  SSE `data: {"error": {...}}` event followed by `data: [DONE]`.
- GET /v1/loads (`v1_loads.py`, `managers/load_snapshot.py`: running requests capped by
  --max-running-requests), GET /metrics only when launched with `--enable-metrics`
  (`enable_metrics` here; Prometheus `sglang:num_running_reqs`, `sglang:num_queue_reqs`,
  `sglang:spec_accept_length`), GET /health, GET /v1/models. No /get_load: 0.5.23 has no such route.
`legacy=True` imitates an older server without /v1/loads (404).
The answers come from tests/stand_ins/responder.py. Faults are injected through `faults`.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from .responder import answer, stream_pieces
from .serve import ServerThread


@dataclass
class Faults:
    fail_next: list[int] = field(default_factory=list)  # HTTP statuses for the next chat requests
    first_token_delay_s: float = 0.0  # before the response / the first streamed event
    chunk_delay_s: float = 0.0
    break_after_chunks: int | None = None  # drop the connection after N content chunks
    error_after_chunks: int | None = None  # send an SSE error event after N content chunks
    abort: bool = False  # finish_reason "abort", as when the scheduler drops the request
    no_usage: bool = False  # no `usage` (a server or gateway without it: OpenAI's field is Optional)


@dataclass
class SGLangStandIn:
    model: str = "stand-in/llama-8b"
    method: str = "off"  # off | eagle | ngram: what --speculative-algorithm the server "runs"
    num_draft_tokens: int = 4
    tokens_per_pass: float = 2.5  # completion tokens per verify pass it reports (as SGLang's spec_accept_length)
    tool_call_parser: str | None = None  # --tool-call-parser: without it tool calls stay text
    enable_metrics: bool = False  # --enable-metrics: without it there is no /metrics
    running: int = 0  # reported num_running_reqs (on top of requests actually in flight)
    max_running_requests: int = 256  # --max-running-requests: num_running_reqs never exceeds it
    waiting: int = 0
    legacy: bool = False  # no /v1/loads (an older server)
    faults: Faults = field(default_factory=Faults)
    requests: list[dict[str, Any]] = field(default_factory=list)
    responses: list[dict[str, Any]] = field(default_factory=list)  # every JSON body / SSE event sent
    load_reads: int = 0
    in_flight: int = 0
    _server: ServerThread | None = None

    # ---- lifecycle ----

    def start(self, port: int = 0) -> SGLangStandIn:
        """Serve on loopback, on `port` where given (a server that comes back where one stalled)."""
        self._server = ServerThread(self.app(), port=port).start()
        return self

    def stop(self) -> None:
        if self._server:
            self._server.stop()

    @property
    def url(self) -> str:
        assert self._server is not None
        return self._server.url

    def __enter__(self) -> SGLangStandIn:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- the app ----

    def app(self) -> FastAPI:
        app = FastAPI()
        stand_in = self

        @app.get("/health")
        async def health():
            return PlainTextResponse("")

        @app.get("/v1/models")
        async def models():
            card = {
                "id": stand_in.model,
                "object": "model",
                "created": int(time.time()),
                "owned_by": "sglang",
                "root": stand_in.model,
                "parent": None,
                "max_model_len": 131072,
            }
            return {"object": "list", "data": [card]}

        @app.get("/v1/loads")
        async def loads(include: str | None = None, dp_rank: int | None = None):
            if stand_in.legacy:
                return JSONResponse({"detail": "Not Found"}, status_code=404)
            stand_in.load_reads += 1
            # managers/load_snapshot.py LoadSnapshot.to_dict: the "core" keys, in field order
            load = {
                "timestamp": time.time(),
                "dp_rank": 0,
                "num_running_reqs": min(stand_in.running + stand_in.in_flight, stand_in.max_running_requests),
                "num_waiting_reqs": stand_in.waiting,
                "num_waiting_uncached_tokens": 0,
                "num_used_tokens": 1000,
                "num_total_tokens": 1200,
                "num_active_tokens": 1200,
                "num_prealloc_ready_tokens": 0,
                "max_total_num_tokens": 500000,
                "max_running_requests": stand_in.max_running_requests,
                "token_usage": 0.002,
                "gen_throughput": 0.0,
                "cache_hit_rate": 0.0,
                "utilization": 0.0,
                "total_prefill_uncached_tokens": 0,
                "total_prefill_busy_us": 0,
                "decode_moments": None,
            }
            if stand_in.method != "off" and include in (None, "all", "spec"):
                load["speculative"] = {"accept_length": stand_in.tokens_per_pass, "accept_rate": 0.5}
            return {
                "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime()),
                "version": "0.5.23",
                "accelerator": "NVIDIA H100 80GB HBM3",
                "num_accelerators": 1,
                "loads": [load],
            }

        if self.enable_metrics:

            @app.get("/metrics")
            async def metrics():
                stand_in.load_reads += 1
                label = f'{{model_name="{stand_in.model}",engine_type="unified",tp_rank="0",pp_rank="0"}}'
                accept = stand_in.tokens_per_pass if stand_in.method != "off" else 1.0
                lines = [
                    "# HELP sglang:num_running_reqs The number of running requests.",
                    "# TYPE sglang:num_running_reqs gauge",
                    f"sglang:num_running_reqs{label} {float(stand_in.running + stand_in.in_flight)}",
                    "# HELP sglang:num_queue_reqs The number of requests in the waiting queue.",
                    "# TYPE sglang:num_queue_reqs gauge",
                    f"sglang:num_queue_reqs{label} {float(stand_in.waiting)}",
                    "# HELP sglang:spec_accept_length The average acceptance length of speculative decoding.",
                    "# TYPE sglang:spec_accept_length gauge",
                    f"sglang:spec_accept_length{label} {accept}",
                ]
                return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            try:
                body = await request.json()
            except ValueError:
                return _error(400, "Invalid JSON body")
            stand_in.requests.append(body)
            if not isinstance(body.get("messages"), list) or not body["messages"]:
                return _error(400, "messages: Field required", param="messages")
            if stand_in.faults.fail_next:
                status = stand_in.faults.fail_next.pop(0)
                return _error(status, f"injected failure {status}")
            stream = bool(body.get("stream"))
            if stream and body.get("return_meta_info"):
                return _error(
                    400,
                    "return_meta_info is not supported with streaming. "
                    "Please set stream=false when using return_meta_info=true.",
                )
            if stream:
                return StreamingResponse(stand_in._stream(body), media_type="text/event-stream")
            stand_in.in_flight += 1
            try:
                if stand_in.faults.first_token_delay_s:
                    await asyncio.sleep(stand_in.faults.first_token_delay_s)
                payload = stand_in._completion(body)
                stand_in.responses.append(payload)
                return JSONResponse(payload)
            finally:
                stand_in.in_flight -= 1

        return app

    # ---- responses ----

    def _answer(self, body: dict[str, Any]):
        """The responder's answer as this server would give it: without a tool-call parser a
        call is not parsed out of the text, so it comes back as the model wrote it."""
        ans = answer(body)
        if ans.tool_calls and (self.tool_call_parser is None or body.get("tool_choice") == "none"):
            text = json.dumps([{"name": tc["function"]["name"], "parameters": json.loads(tc["function"]["arguments"])}
                               for tc in ans.tool_calls])  # fmt: skip
            ans.tool_calls, ans.words, ans.finish_reason = [], [text], "stop"
        return ans

    def _spec_counters(self, completion_tokens: int) -> dict[str, Any] | None:
        """tokenizer_manager.py `_calculate_spec_decoding_metrics`, 0.5.23 names."""
        if self.method == "off" or completion_tokens <= 0:
            return None
        verify_ct = max(1, math.ceil(completion_tokens / self.tokens_per_pass))
        proposed = verify_ct * (self.num_draft_tokens - 1)
        accepted = max(0, min(proposed, completion_tokens - verify_ct))
        return {
            "spec_accept_rate": accepted / proposed,
            "spec_accept_length": completion_tokens / verify_ct,
            "spec_num_correct_drafts": accepted,
            "spec_num_proposed_drafts": proposed,
            "spec_verify_ct": verify_ct,
            "spec_correct_drafts_histogram": _histogram(accepted, verify_ct, self.num_draft_tokens - 1),
        }

    def _sglext(self, body: dict[str, Any], counters: dict[str, Any] | None) -> dict[str, Any] | None:
        """SglExt with spec_tokens_details (every SpecTokensDetails field), when asked and present."""
        if not body.get("return_spec_tokens_details") or counters is None:
            return None
        details = {
            "spec_accept_rate": counters["spec_accept_rate"],
            "spec_accept_length": counters["spec_accept_length"],
            "spec_cap_length": 0.0,
            "spec_block_accept_length": 0.0,
            "spec_num_correct_drafts": counters["spec_num_correct_drafts"],
            "spec_num_proposed_drafts": counters["spec_num_proposed_drafts"],
            "spec_verify_ct": counters["spec_verify_ct"],
            "spec_correct_drafts_histogram": counters["spec_correct_drafts_histogram"],
            "spec_cap_lens_histogram": [],
        }
        return {"spec_tokens_details": details}

    def _meta_info(self, rid: str, ans, finish: str, counters: dict[str, Any] | None) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": rid,
            "finish_reason": {"type": finish} if finish != "stop" else {"type": "stop", "matched": 2},
            "prompt_tokens": ans.prompt_tokens,
            "weight_version": "default",
            "total_retractions": 0,
            "completion_tokens": ans.completion_tokens,
            "cached_tokens": 0,
            "e2e_latency": 0.01,
        }
        meta.update(counters or {})
        return meta

    def _usage(self, ans) -> dict[str, Any]:
        return {
            "prompt_tokens": ans.prompt_tokens,
            "total_tokens": ans.prompt_tokens + ans.completion_tokens,
            "completion_tokens": ans.completion_tokens,
            "prompt_tokens_details": None,
            "reasoning_tokens": 0,
            "completion_tokens_details": None,
        }

    def _completion(self, body: dict[str, Any]) -> dict[str, Any]:
        ans = self._answer(body)
        rid = uuid.uuid4().hex
        finish = "abort" if self.faults.abort else ans.finish_reason
        counters = self._spec_counters(ans.completion_tokens)
        message: dict[str, Any] = {
            "role": "assistant",
            "content": ans.text,  # "" beside tool calls, never null
            "reasoning_content": None,
        }
        if ans.tool_calls:
            message["tool_calls"] = [_tool_call(tc, i) for i, tc in enumerate(ans.tool_calls)]
        choice: dict[str, Any] = {
            "index": 0,
            "message": message,
            "logprobs": None,
            "finish_reason": finish,
            "matched_stop": 2 if finish == "stop" else None,
        }
        if body.get("return_meta_info"):
            choice["meta_info"] = self._meta_info(rid, ans, finish, counters)
        out: dict[str, Any] = {
            "id": rid,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.get("model") or self.model,
            "choices": [choice],
            "usage": None if self.faults.no_usage else self._usage(ans),
            "metadata": {"weight_version": "default"},
        }
        sglext = self._sglext(body, counters)
        if sglext is not None:
            out["sglext"] = sglext
        return out

    async def _stream(self, body: dict[str, Any]):
        faults = self.faults
        ans = self._answer(body)
        rid = uuid.uuid4().hex
        model = body.get("model") or self.model
        created = int(time.time())
        sent = self.responses

        def emit(chunk: dict[str, Any]) -> str:
            sent.append(chunk)
            return f"data: {json.dumps(chunk)}\n\n"

        def head() -> dict[str, Any]:
            return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}

        def msgspec_chunk(delta: dict[str, Any], finish: str | None = None, matched=None) -> str:
            """sse_utils.build_sse_content: StreamDelta keeps reasoning_content, drops unset others;
            StreamChunk drops an unset usage."""
            choice = {"index": 0, "delta": {"reasoning_content": None, **delta}, "logprobs": None,
                      "finish_reason": finish, "matched_stop": matched}  # fmt: skip
            return emit({**head(), "choices": [choice]})

        def pydantic_chunk(delta: dict[str, Any]) -> str:
            """ChatCompletionStreamResponse.model_dump_json with a DeltaMessage."""
            full = {"role": None, "content": None, "reasoning_content": None, **delta}
            choice = {
                "index": 0,
                "delta": full,
                "logprobs": None,
                "finish_reason": None,
                "matched_stop": None,
            }
            return emit({**head(), "choices": [choice], "usage": None})

        self.in_flight += 1
        try:
            if faults.first_token_delay_s:
                await asyncio.sleep(faults.first_token_delay_s)
            yield msgspec_chunk({"role": "assistant", "content": ""})
            pieces: list[tuple[str, dict[str, Any]]] = []
            for i, tc in enumerate(ans.tool_calls):
                name = {"name": tc["function"]["name"], "arguments": ""}
                pieces.append(
                    (
                        "tool",
                        {
                            "tool_calls": [
                                {"id": _call_id(), "index": i, "type": "function", "function": name}
                            ]
                        },
                    )
                )
                args = {"name": None, "arguments": tc["function"]["arguments"]}
                pieces.append(
                    ("tool", {"tool_calls": [{"id": None, "index": i, "type": "function", "function": args}]})
                )
            pieces += [("text", {"content": p}) for p in stream_pieces(ans)]
            for n, (kind, delta) in enumerate(pieces):
                if faults.break_after_chunks is not None and n >= faults.break_after_chunks:
                    raise ConnectionAbortedError("injected: connection dropped mid-stream")
                if faults.error_after_chunks is not None and n >= faults.error_after_chunks:
                    err = {
                        "object": "error",
                        "message": "injected stream error",
                        "type": "InternalServerError",
                        "param": None,
                        "code": 500,
                    }
                    yield f"data: {json.dumps({'error': err})}\n\n"
                    yield "data: [DONE]\n\n"
                    return
                if faults.chunk_delay_s:
                    await asyncio.sleep(faults.chunk_delay_s)
                yield pydantic_chunk(delta) if kind == "tool" else msgspec_chunk(delta)
            finish = "abort" if faults.abort else ans.finish_reason
            yield msgspec_chunk({}, finish=finish, matched=2 if finish == "stop" else None)
            sglext = self._sglext(body, self._spec_counters(ans.completion_tokens))
            if sglext is not None:
                yield emit({**head(), "choices": [], "usage": None, "sglext": sglext})
            if (body.get("stream_options") or {}).get("include_usage") and not faults.no_usage:
                yield emit({**head(), "choices": [], "usage": self._usage(ans)})
            yield "data: [DONE]\n\n"
        finally:
            self.in_flight -= 1


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"  # serving_chat.py `_process_tool_call_id`


def _tool_call(tc: dict[str, Any], index: int) -> dict[str, Any]:
    """protocol.py ToolCall: id, index (the call's ordinal), type, function {name, arguments}."""
    return {"id": _call_id(), "index": index, "type": "function", "function": dict(tc["function"])}


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    kind = {400: "BadRequestError", 404: "NotFoundError", 429: "TooManyRequestsError"}.get(
        status, "InternalServerError" if status >= 500 else "BadRequestError"
    )
    body = {"object": "error", "message": message, "type": kind, "param": param, "code": status}
    headers = {"Retry-After": "1"} if status == 429 else None
    return JSONResponse(body, status_code=status, headers=headers)


def _histogram(accepted: int, rounds: int, gamma: int) -> list[int]:
    """Rounds that accepted k drafts, spread as evenly as the totals allow; as SGLang grows it
    (schedule_batch.py `update_spec_correct_drafts_histogram`), only as long as the largest k + 1."""
    hist = [0] * (gamma + 1)
    base, extra = divmod(accepted, rounds)
    for i in range(rounds):
        hist[min(gamma, base + (1 if i < extra else 0))] += 1
    while len(hist) > 1 and hist[-1] == 0:
        hist.pop()
    return hist
