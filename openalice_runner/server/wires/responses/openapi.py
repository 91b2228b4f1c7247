"""The Responses body's schema in the OpenAPI document (the body is read by the wire, not by FastAPI), its
definitions named `Responses*` so they never take the place of the chat body's."""

from __future__ import annotations

import json

from fastapi import FastAPI

from openalice_runner.server.chat_schema import with_schemas
from openalice_runner.server.wires.responses.schema import ResponsesRequest

_PREFIX = "Responses"
_SCHEMA = ResponsesRequest.model_json_schema(ref_template=f"#/components/schemas/{_PREFIX}{{model}}")
_DEFS = {f"{_PREFIX}{name}": schema for name, schema in _SCHEMA.pop("$defs", {}).items()}
RESPONSES_BODY_DOC = {"requestBody": {"required": True, "content": {"application/json": {"schema": _SCHEMA}}}}
assert "#/$defs/" not in json.dumps(_SCHEMA) + json.dumps(_DEFS)  # every reference points at a component


def with_responses_schemas(app: FastAPI) -> None:
    with_schemas(app, _DEFS)
