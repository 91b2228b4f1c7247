"""The chat body's schema in the OpenAPI document: the body is read by read_chat_request (server/body.py),
not by FastAPI, so the document is told what it is."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from openalice_runner.server.validation import ServerChatRequest

_CHAT_SCHEMA = ServerChatRequest.model_json_schema(ref_template="#/components/schemas/{model}")
_CHAT_DEFS = _CHAT_SCHEMA.pop("$defs", {})
CHAT_BODY_DOC = {"requestBody": {"required": True, "content": {"application/json": {"schema": _CHAT_SCHEMA}}}}


def with_chat_schemas(app: FastAPI) -> None:
    """Add the schemas the chat body refers to ($defs) to the app's OpenAPI components."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        doc = generate()
        doc.setdefault("components", {}).setdefault("schemas", {}).update(_CHAT_DEFS)
        return doc

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented way to extend the schema
