"""Run by the SGLang contract venv's python (scripts/sglang-contract-venv.sh), never by the runner's.

Reads JSON from stdin: {"requests": [...], "responses": [...], "chunks": [...], "errors": [...],
"flags": [[arg, ...], ...]} and checks each against SGLang's own code:
- requests: ChatCompletionRequest accepts the body the runner sends;
- responses: ChatCompletionResponse accepts the body and serializes back to exactly it;
- chunks: each SSE chunk is what SGLang builds: the msgspec StreamChunk of sse_utils.py
  (content, role opener, finish) or ChatCompletionStreamResponse (tool calls, sglext, usage),
  decoded and encoded back to exactly it;
- errors: ErrorResponse, round trip;
- flags: `ServerArgs.add_cli_args` parses `--model-path m` + the flags; prints the parsed values.
Prints one JSON object: {"failures": [...], "checked": {...}, "flags": [...]}.
"""

from __future__ import annotations

import argparse
import json
import sys

import msgspec
from sglang.srt.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    ErrorResponse,
)
from sglang.srt.entrypoints.openai.sse_utils import StreamChunk


def _roundtrip_pydantic(cls, body):
    obj = cls.model_validate(body)
    return json.loads(obj.model_dump_json())


def _roundtrip_msgspec(body):
    obj = msgspec.json.decode(json.dumps(body).encode(), type=StreamChunk)
    return json.loads(msgspec.json.encode(obj))


def main() -> None:
    data = json.load(sys.stdin)
    failures: list[str] = []
    checked = {"requests": 0, "responses": 0, "chunks": 0, "errors": 0, "flags": 0}

    def check(kind: str, i: int, body, fn) -> None:
        try:
            back = fn(body)
        except Exception as exc:  # noqa: BLE001 - every failure is reported
            failures.append(f"{kind}[{i}]: rejected: {type(exc).__name__}: {exc}"[:2000])
            return
        if back is not None and back != body:
            failures.append(
                f"{kind}[{i}]: SGLang serializes it as {json.dumps(back)}, stand-in sent {json.dumps(body)}"
            )
            return
        checked[kind] += 1

    for i, body in enumerate(data.get("requests", [])):
        check("requests", i, body, lambda b: (ChatCompletionRequest.model_validate(b), None)[1])
    for i, body in enumerate(data.get("responses", [])):
        check("responses", i, body, lambda b: _roundtrip_pydantic(ChatCompletionResponse, b))
    for i, body in enumerate(data.get("chunks", [])):
        # sse_utils' StreamChunk omits an unset usage; ChatCompletionStreamResponse always has it
        if "usage" in body:
            check("chunks", i, body, lambda b: _roundtrip_pydantic(ChatCompletionStreamResponse, b))
        else:
            check(
                "chunks",
                i,
                body,
                lambda b: (ChatCompletionStreamResponse.model_validate(b), _roundtrip_msgspec(b))[1],
            )
    for i, body in enumerate(data.get("errors", [])):
        check("errors", i, body, lambda b: _roundtrip_pydantic(ErrorResponse, b))

    parsed_flags = []
    if data.get("flags"):
        from sglang.srt.server_args import ServerArgs

        for i, args in enumerate(data["flags"]):
            parser = argparse.ArgumentParser(exit_on_error=False)
            ServerArgs.add_cli_args(parser)
            try:
                ns = parser.parse_args(["--model-path", "m", *args])
            except (argparse.ArgumentError, SystemExit) as exc:
                failures.append(f"flags[{i}]: {args}: {exc}")
                parsed_flags.append(None)
                continue
            checked["flags"] += 1
            parsed_flags.append(
                {k: v for k, v in vars(ns).items() if isinstance(v, (str, int, float, bool, type(None)))}
            )
    print(json.dumps({"failures": failures, "checked": checked, "flags": parsed_flags}))


if __name__ == "__main__":
    main()
