"""The request bodies' schemas in the OpenAPI document: each wire reads its body itself (server/body.py,
server/wires/), not FastAPI, so the document is told what they are."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from openalice_runner.server.validation import ServerChatRequest
from openalice_runner.server.wires.messages_request import CountTokensRequest, MessagesRequest

_DEFS: dict[str, Any] = {}


def _body_doc(model: type[Any]) -> dict[str, Any]:
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    _DEFS.update(schema.pop("$defs", {}))
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


CHAT_BODY_DOC = _body_doc(ServerChatRequest)
MESSAGES_BODY_DOC = _body_doc(MessagesRequest)
COUNT_TOKENS_BODY_DOC = _body_doc(CountTokensRequest)


def with_chat_schemas(app: FastAPI) -> None:
    """Add the schemas the bodies refer to ($defs) to the app's OpenAPI components."""
    with_schemas(app, _DEFS)


def with_schemas(app: FastAPI, defs: dict[str, Any]) -> None:
    """Add `defs` to the schemas of the app's OpenAPI components, each time the document is made."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        doc = generate()
        doc.setdefault("components", {}).setdefault("schemas", {}).update(defs)
        return doc

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented way to extend the schema
