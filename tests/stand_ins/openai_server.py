"""Stand-in hosted API (no internet here): OpenAI's Chat Completions over HTTP on loopback.

Speaks what the openai SDK (and litellm through it) parses: `chat.completion` bodies, SSE
`chat.completion.chunk` events ending in `data: [DONE]` (usage chunk with empty `choices` when
`stream_options.include_usage`), and errors as `{"error": {"message", "type", "param", "code"}}`
with the HTTP status (429 with a Retry-After header).

The answer comes from a `backend(body) -> Answer`: the deterministic responder by default, or the
embedded engine's tiny random model (`engine_backend`). Faults are injected through `faults`.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from .responder import Answer, answer, stream_pieces
from .serve import ServerThread


@dataclass
class OpenAIFaults:
    fail_next: list[int] = field(default_factory=list)  # statuses for the next requests
    retry_after_s: float = 0.05  # Retry-After sent with 429
    delay_s: float = 0.0  # before answering (or before the first chunk)
    break_after_chunks: int | None = None  # drop the connection after N content chunks


@dataclass
class OpenAIStandIn:
    backend: Callable[[dict[str, Any]], Answer] = answer
    faults: OpenAIFaults = field(default_factory=OpenAIFaults)
    requests: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    _server: ServerThread | None = None

    def start(self) -> OpenAIStandIn:
        self._server = ServerThread(self.app()).start()
        return self

    def stop(self) -> None:
        if self._server:
            self._server.stop()

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"{self._server.url}/v1"

    def __enter__(self) -> OpenAIStandIn:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def app(self) -> FastAPI:
        app = FastAPI()
        stand_in = self

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            body = await request.json()
            stand_in.requests.append(body)
            stand_in.headers.append(dict(request.headers))
            if not isinstance(body.get("messages"), list) or not body["messages"]:
                return _error(400, "'messages' is a required property", "invalid_request_error", "messages")
            if stand_in.faults.fail_next:
                status = stand_in.faults.fail_next.pop(0)
                kind = "rate_limit_exceeded" if status == 429 else "server_error"
                return _error(status, f"injected {status}", kind, None, stand_in.faults.retry_after_s)
            if stand_in.faults.delay_s:
                await asyncio.sleep(stand_in.faults.delay_s)
            ans = stand_in.backend(body)
            if body.get("stream"):
                return StreamingResponse(stand_in._stream(body, ans), media_type="text/event-stream")
            return JSONResponse(_completion(body, ans))

        return app

    async def _stream(self, body: dict[str, Any], ans: Answer):
        rid, created, model = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time()), body.get("model", "")

        def event(choices: list[dict[str, Any]], usage: Any = None) -> str:
            chunk = {
                "id": rid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
                "system_fingerprint": None,
                "choices": choices,
            }
            if usage is not None:
                chunk["usage"] = usage
            return f"data: {json.dumps(chunk)}\n\n"

        def choice(delta: dict[str, Any], finish: str | None = None) -> list[dict[str, Any]]:
            return [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]

        yield event(choice({"role": "assistant", "content": "", "refusal": None}))
        deltas: list[dict[str, Any]] = []
        for tc in ans.tool_calls:
            deltas.append(
                {
                    "tool_calls": [
                        {
                            "index": 0,
                            "id": tc["id"],
                            "type": "function",
                            "function": {"name": tc["function"]["name"], "arguments": ""},
                        }
                    ]
                }
            )
            deltas.append(
                {"tool_calls": [{"index": 0, "function": {"arguments": tc["function"]["arguments"]}}]}
            )
        deltas += [{"content": p} for p in stream_pieces(ans)]
        for n, delta in enumerate(deltas):
            if self.faults.break_after_chunks is not None and n >= self.faults.break_after_chunks:
                raise ConnectionAbortedError("injected: connection dropped mid-stream")
            yield event(choice(delta))
        yield event(choice({}, ans.finish_reason))
        if (body.get("stream_options") or {}).get("include_usage"):
            yield event([], usage=_usage(ans))
        yield "data: [DONE]\n\n"


def _usage(ans: Answer) -> dict[str, int]:
    return {
        "prompt_tokens": ans.prompt_tokens,
        "completion_tokens": ans.completion_tokens,
        "total_tokens": ans.prompt_tokens + ans.completion_tokens,
    }


def _completion(body: dict[str, Any], ans: Answer) -> dict[str, Any]:
    message: dict[str, Any] = {
        "role": "assistant",
        "content": None if ans.tool_calls else ans.text,
        "refusal": None,
    }
    if ans.tool_calls:
        message["tool_calls"] = [{k: v for k, v in tc.items() if k != "index"} for tc in ans.tool_calls]
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex[:24]}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": body.get("model", ""),
        "system_fingerprint": None,
        "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": ans.finish_reason}],
        "usage": _usage(ans),
    }


def _error(
    status: int, message: str, kind: str, param: str | None, retry_after: float | None = None
) -> JSONResponse:
    body = {"error": {"message": message, "type": kind, "param": param, "code": kind}}
    headers = {"retry-after": str(retry_after)} if status == 429 and retry_after is not None else None
    return JSONResponse(body, status_code=status, headers=headers)


def engine_backend(engine: Any, max_tokens: int = 16) -> Callable[[dict[str, Any]], Answer]:
    """Answers from the embedded engine (the tiny random model in tests): real tokens, real counts."""
    from openalice_runner.engine.types import SamplingParams, SpecConfig

    def backend(body: dict[str, Any]) -> Answer:
        ids = engine.render_chat(body["messages"])
        limit = int(body.get("max_tokens") or body.get("max_completion_tokens") or max_tokens)
        result = engine.generate(ids, SamplingParams(max_tokens=limit, temperature=0.0), SpecConfig())
        text = result.text
        ans = Answer(text.split(" ") if text else [], prompt_tokens=len(ids))
        ans.finish_reason = "length" if result.finish_reason in ("length", "context_length") else "stop"
        return ans

    return backend
