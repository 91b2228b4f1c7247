"""The Responses body, parsed and validated off the event loop (tool schemas are checked in Python,
see server/body.py), each problem an APIError naming its field the way OpenAI names it."""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError

from openalice_runner.server.body import NOT_AN_OBJECT, _is_json
from openalice_runner.server.errors import APIError, utf8_error
from openalice_runner.server.validation import first_bad_string
from openalice_runner.server.wires.responses.errors import from_validation
from openalice_runner.server.wires.responses.schema import ResponsesRequest


def parse_responses_request(raw: bytes, content_type: str | None) -> ResponsesRequest:
    if not raw or not _is_json(content_type):
        raise APIError(400, NOT_AN_OBJECT, code="invalid_body")
    try:
        data: Any = json.loads(raw)
    except UnicodeDecodeError as exc:
        raise utf8_error(exc) from None
    except json.JSONDecodeError as exc:
        raise APIError(400, f"request body is not valid JSON: {exc.msg} (at offset {exc.pos})",
                       code="invalid_json") from None  # fmt: skip
    except RecursionError:
        raise APIError(400, "request body is nested too deeply to parse", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, NOT_AN_OBJECT, code="invalid_body")
    bad = first_bad_string(data, "")
    if bad is not None:  # JSON can carry lone surrogates, which no tokenizer takes
        raise APIError(400, f"{bad or 'body'}: not valid Unicode (a lone surrogate escape)",
                       param=bad or None, code="invalid_unicode")  # fmt: skip
    try:
        return ResponsesRequest.model_validate(data)
    except ValidationError as exc:
        raise from_validation(exc) from None
    except RecursionError:
        raise APIError(400, "request body is nested too deeply to validate", code="invalid_value") from None
