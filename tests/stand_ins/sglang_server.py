"""Stand-in SGLang server (SGLang needs a GPU): the HTTP surface the runner uses, field for field.

Imitates SGLang 0.5.x `python/sglang/srt/entrypoints/http_server.py`, `openai/serving_chat.py`,
`openai/protocol.py`, `v1_loads.py` and `managers/io_struct.py`:
- POST /v1/chat/completions: ChatCompletionResponse (`id`, `object`, `created`, `model`, `choices`
  [`index`, `message` {`role`, `content`, `reasoning_content`, `tool_calls`}, `logprobs`,
  `finish_reason`, `matched_stop`, and `meta_info` when the request sets `return_meta_info`],
  `usage` {`prompt_tokens`, `total_tokens`, `completion_tokens`, `prompt_tokens_details`,
  `reasoning_tokens`}, `metadata`). With speculation on, `meta_info` holds `spec_verify_ct`,
  `spec_accept_rate`, `spec_accept_length`, `spec_accepted_drafts`, `spec_proposed_drafts`,
  `spec_accept_histogram` (0.5.x names). `return_meta_info` with `stream` is refused (400), as in SGLang.
- streaming: SSE `data: {chat.completion.chunk}` events: a role opener (`delta` role "assistant",
  content ""), content deltas, a finish chunk (empty delta, `finish_reason`, `matched_stop`), a usage
  chunk (`choices` []) when `stream_options.include_usage`, then `data: [DONE]`.
- errors: HTTP status with `{"object": "error", "message", "type", "param", "code"}`; in a stream an
  SSE `data: {"error": {...}}` event followed by `data: [DONE]`.
- GET /v1/loads (newer servers; `legacy=True` answers 404 like 0.5.x before it), GET /get_load
  (list of {dp_rank, num_reqs, num_waiting_reqs, num_tokens}), GET /metrics (Prometheus
  `sglang:num_running_reqs`, `sglang:num_queue_reqs`, `sglang:spec_accept_length`), GET /health,
  GET /v1/models.
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


@dataclass
class SGLangStandIn:
    model: str = "stand-in/llama-8b"
    method: str = "off"  # off | eagle | ngram: what --speculative-algorithm the server "runs"
    num_draft_tokens: int = 4
    accept_length: float = 2.5  # completion tokens per verify pass it reports
    running: int = 0  # reported num_running_reqs (on top of requests actually in flight)
    waiting: int = 0
    legacy: bool = False  # no /v1/loads (0.5.x before it existed)
    metrics_only: bool = False  # neither /v1/loads nor /get_load
    faults: Faults = field(default_factory=Faults)
    requests: list[dict[str, Any]] = field(default_factory=list)
    load_reads: int = 0
    in_flight: int = 0
    _server: ServerThread | None = None

    # ---- lifecycle ----

    def start(self) -> SGLangStandIn:
        self._server = ServerThread(self.app()).start()
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
            }
            return {"object": "list", "data": [card]}

        @app.get("/v1/loads")
        async def loads(include: str | None = None, dp_rank: int | None = None):
            if stand_in.legacy or stand_in.metrics_only:
                return JSONResponse({"detail": "Not Found"}, status_code=404)
            stand_in.load_reads += 1
            load = {
                "dp_rank": 0,
                "timestamp": time.time(),
                "num_running_reqs": stand_in.running + stand_in.in_flight,
                "num_waiting_reqs": stand_in.waiting,
                "num_used_tokens": 1000,
                "num_total_tokens": 1200,
                "max_total_num_tokens": 500000,
                "token_usage": 0.002,
                "gen_throughput": 0.0,
                "cache_hit_rate": 0.0,
                "utilization": 0.0,
                "max_running_requests": 256,
            }
            if stand_in.method != "off" and include in (None, "all", "spec"):
                load["speculative"] = {"accept_length": stand_in.accept_length, "accept_rate": 0.5}
            return {
                "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime()),
                "version": "0.5.9",
                "accelerator": "NVIDIA H100 80GB HBM3",
                "num_accelerators": 1,
                "loads": [load],
            }

        @app.get("/get_load")
        async def get_load():
            if stand_in.metrics_only:
                return JSONResponse({"detail": "Not Found"}, status_code=404)
            stand_in.load_reads += 1
            return [
                {
                    "dp_rank": 0,
                    "num_reqs": stand_in.running + stand_in.in_flight,
                    "num_waiting_reqs": stand_in.waiting,
                    "num_tokens": 1000,
                }
            ]

        @app.get("/metrics")
        async def metrics():
            stand_in.load_reads += 1
            label = f'{{model_name="{stand_in.model}",engine_type="unified",tp_rank="0",pp_rank="0"}}'
            lines = [
                "# HELP sglang:num_running_reqs The number of running requests.",
                "# TYPE sglang:num_running_reqs gauge",
                f"sglang:num_running_reqs{label} {float(stand_in.running + stand_in.in_flight)}",
                "# HELP sglang:num_queue_reqs The number of requests in the waiting queue.",
                "# TYPE sglang:num_queue_reqs gauge",
                f"sglang:num_queue_reqs{label} {float(stand_in.waiting)}",
                "# HELP sglang:spec_accept_length The average acceptance length of speculative decoding.",
                "# TYPE sglang:spec_accept_length gauge",
                f"sglang:spec_accept_length{label} {stand_in.accept_length if stand_in.method != 'off' else 1.0}",
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
                return stand_in._completion(body)
            finally:
                stand_in.in_flight -= 1

        return app

    # ---- responses ----

    def _meta_info(self, completion_tokens: int, prompt_tokens: int, finish: str) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": uuid.uuid4().hex,
            "finish_reason": {"type": finish} if finish != "stop" else {"type": "stop", "matched": 2},
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "cached_tokens": 0,
            "e2e_latency": 0.01,
        }
        if self.method != "off" and completion_tokens > 0:
            verify_ct = max(1, math.ceil(completion_tokens / self.accept_length))
            proposed = verify_ct * (self.num_draft_tokens - 1)
            accepted = min(proposed, completion_tokens - verify_ct)
            meta.update(
                spec_verify_ct=verify_ct,
                spec_accept_rate=accepted / proposed,
                spec_accept_length=completion_tokens / verify_ct,
                spec_accepted_drafts=accepted,
                spec_proposed_drafts=proposed,
                spec_accept_histogram=_histogram(accepted, verify_ct, self.num_draft_tokens - 1),
            )
        return meta

    def _completion(self, body: dict[str, Any]) -> JSONResponse:
        ans = answer(body)
        finish = "abort" if self.faults.abort else ans.finish_reason
        choice: dict[str, Any] = {
            "index": 0,
            "message": {
                "role": "assistant",
                "content": None if ans.tool_calls else ans.text,
                "reasoning_content": None,
                "tool_calls": [{k: v for k, v in tc.items() if k != "index"} for tc in ans.tool_calls]
                or None,
            },
            "logprobs": None,
            "finish_reason": finish,
            "matched_stop": None,
        }
        if body.get("return_meta_info"):
            choice["meta_info"] = self._meta_info(ans.completion_tokens, ans.prompt_tokens, finish)
        return JSONResponse(
            {
                "id": uuid.uuid4().hex,
                "object": "chat.completion",
                "created": int(time.time()),
                "model": body.get("model") or self.model,
                "choices": [choice],
                "usage": {
                    "prompt_tokens": ans.prompt_tokens,
                    "total_tokens": ans.prompt_tokens + ans.completion_tokens,
                    "completion_tokens": ans.completion_tokens,
                    "prompt_tokens_details": None,
                    "reasoning_tokens": 0,
                },
                "metadata": {"weight_version": "default"},
            }
        )

    async def _stream(self, body: dict[str, Any]):
        faults = self.faults
        ans = answer(body)
        rid = uuid.uuid4().hex
        model = body.get("model") or self.model
        created = int(time.time())

        def event(
            delta: dict[str, Any] | None, finish: str | None = None, usage: Any = None, choices=True
        ) -> str:
            chunk = {
                "id": rid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
                "choices": (
                    [
                        {
                            "index": 0,
                            "delta": delta or {},
                            "logprobs": None,
                            "finish_reason": finish,
                            "matched_stop": None,
                        }
                    ]
                    if choices
                    else []
                ),
                "usage": usage,
            }
            return f"data: {json.dumps(chunk)}\n\n"

        self.in_flight += 1
        try:
            if faults.first_token_delay_s:
                await asyncio.sleep(faults.first_token_delay_s)
            yield event({"role": "assistant", "content": "", "reasoning_content": None, "tool_calls": None})
            pieces: list[dict[str, Any]] = []
            for tc in ans.tool_calls:
                head = {
                    "index": 0,
                    "id": tc["id"],
                    "type": "function",
                    "function": {"name": tc["function"]["name"], "arguments": ""},
                }
                pieces.append({"tool_calls": [head]})
                pieces.append(
                    {"tool_calls": [{"index": 0, "function": {"arguments": tc["function"]["arguments"]}}]}
                )
            pieces += [{"content": p} for p in stream_pieces(ans)]
            for n, delta in enumerate(pieces):
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
                yield event(delta)
            finish = "abort" if faults.abort else ans.finish_reason
            yield event({}, finish=finish)
            if (body.get("stream_options") or {}).get("include_usage"):
                usage = {
                    "prompt_tokens": ans.prompt_tokens,
                    "total_tokens": ans.prompt_tokens + ans.completion_tokens,
                    "completion_tokens": ans.completion_tokens,
                    "prompt_tokens_details": None,
                    "reasoning_tokens": 0,
                }
                yield event(None, usage=usage, choices=False)
            yield "data: [DONE]\n\n"
        finally:
            self.in_flight -= 1


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    kind = {400: "BadRequestError", 404: "NotFoundError", 429: "TooManyRequestsError"}.get(
        status, "InternalServerError" if status >= 500 else "BadRequestError"
    )
    body = {"object": "error", "message": message, "type": kind, "param": param, "code": status}
    headers = {"Retry-After": "1"} if status == 429 else None
    return JSONResponse(body, status_code=status, headers=headers)


def _histogram(accepted: int, rounds: int, gamma: int) -> list[int]:
    """Rounds that accepted k drafts (k = 0..gamma), spread as evenly as the totals allow."""
    hist = [0] * (gamma + 1)
    base, extra = divmod(accepted, rounds)
    for i in range(rounds):
        hist[min(gamma, base + (1 if i < extra else 0))] += 1
    return hist
