"""Wire shapes: each API the sidecar speaks is a thin translation onto one request path.

server/pipeline.py's `RequestPipeline` runs every request the same way whatever its wire: turn context,
deadline, admission (429 before any work), the turn span (TurnTracker), the runner call (policy,
providers, fallback) and the metrics. A wire only translates, in four places (server/wires/base.py types
them as `Wire` and `StreamFormat`):

1. `read(request, settings) -> WireCall`: its body, parsed and validated, made into the chat request
   (`ServerChatRequest`, OpenAI's Chat Completions body, which every provider serves), plus what the
   wire's own keys say of the turn: `conversation_id` (and `conversation_source`, the key it came from)
   from its session keys, used where no X-OpenAlice-Conversation-Id header / metadata states one.
   `state` carries whatever the wire needs back to format the answer (its model name, the tools it
   offered, ...). Parse in a worker thread where it can be heavy (server/body.py's `in_thread`): tool
   schemas are checked there. Bad input raises APIError naming the field (its `param`), answered in
   this wire's error shape.
2. `reply(result: ChatResult, call) -> Response`: a whole answer in the wire's shape.
3. `stream_format(call) -> StreamFormat`: a fresh formatter per stream; server/streaming.py's SSEStream
   feeds it each ChatChunk (`chunk`), then `end(last, usage)`, or `error(api_error)` for a fault after
   the stream started; it yields the wire's SSE event bytes. SSEStream keeps the bookkeeping (in-flight
   gauge, the turn's step, metrics, closing the provider's stream) exactly once however the stream ends;
   a formatter holds no resources, only the state of its events.
4. `error_body(APIError) -> (status, body, headers)`: errors in the wire's shape. `error_response(path,
   error)` below picks the wire by the request's path, so every error on a wire's routes is in its shape:
   the guard's 401/413/503 (server/guard.py), validation's 400s, the pipeline's 429/404/5xx and the
   unexpected 500 alike (server/errors.py's handlers). `stream_error(APIError) -> bytes`: the SSE
   event that ends a stream of the wire where no formatter is at hand (the guard's shutdown cut).

A new wire: a module here with a class of those methods, an entry in `WIRES_BY_PREFIX` (its routes'
path prefix), and its route(s) in server/app.py: `app.post(path)(pipeline.handler(wire))`.
"""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

from openalice_runner.server.errors import APIError
from openalice_runner.server.wires.base import StreamFormat, Wire, WireCall, session_key
from openalice_runner.server.wires.chat import ChatCompletionsWire
from openalice_runner.server.wires.messages import MESSAGES
from openalice_runner.server.wires.responses.wire import ResponsesWire

CHAT = ChatCompletionsWire()

# Path prefix -> the wire whose error shape answers it; anything else is answered in OpenAI's.
WIRES_BY_PREFIX: tuple[tuple[str, Any], ...] = (("/v1/messages", MESSAGES), ("/v1/responses", ResponsesWire()))


def wire_for_path(path: str) -> Wire:
    for prefix, wire in WIRES_BY_PREFIX:
        if path == prefix or path.startswith(prefix + "/"):
            return wire
    return CHAT


def error_parts(path: str, error: APIError) -> tuple[int, dict[str, Any], dict[str, str]]:
    return wire_for_path(path).error_body(error)


def error_response(path: str, error: APIError) -> JSONResponse:
    status, body, headers = error_parts(path, error)
    return JSONResponse(body, status_code=status, headers=headers or None)


__all__ = [
    "CHAT",
    "MESSAGES",
    "StreamFormat",
    "WIRES_BY_PREFIX",
    "Wire",
    "WireCall",
    "error_parts",
    "error_response",
    "session_key",
    "wire_for_path",
]
