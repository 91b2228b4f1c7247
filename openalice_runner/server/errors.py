"""The API's errors: `APIError` holds one in OpenAI's terms (status, type, param, code), and its body
is OpenAI's {"error": {"message", "type", "param", "code"}}; a route of another wire answers it in that
wire's shape (server/wires/, `error_body`), by the handlers installed here.

Messages never carry secrets: provider errors are reported by class and status, and unexpected
exceptions only as "internal error" (the details go to the log, with the trace id).
"""

from __future__ import annotations

import json
from typing import Any

import structlog
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from openalice_runner.types import FieldError

log = structlog.get_logger("openalice_runner.server")

# OpenAI's error "type" per status family.
_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    409: "conflict_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    502: "server_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}


class APIError(Exception):
    """An error the API reports as such: status, OpenAI type/param/code, optional headers."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPE_BY_STATUS.get(
            status_code, "server_error" if status_code >= 500 else "invalid_request_error"
        )
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status_code, headers=self.headers)


def _loc_to_param(loc: tuple[Any, ...] | list[Any]) -> str | None:
    """FastAPI's ('body', 'messages', 2, 'tool_call_id') -> 'messages[2].tool_call_id'."""
    parts = [p for p in loc if p != "body"]
    # pydantic adds the union member / validator tag to the location; they are not field names.
    out = ""
    for p in parts:
        if isinstance(p, int):
            out += f"[{p}]"
        elif isinstance(p, str) and (
            p.startswith("function-") or p in {"str", "list[TextPart]", "NamedToolChoice", "AllowedToolChoice"}
        ):
            continue
        else:
            out += f".{p}" if out else str(p)
    return out or None


# pydantic's error types for a body that is not an object at all (a string, a list, ...).
_NOT_AN_OBJECT = frozenset({"model_attributes_type", "model_type", "dict_type", "missing"})


def validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    if not errors:
        return APIError(400, "invalid request body")
    first = errors[0]
    if first.get("type") == "json_invalid":
        return APIError(400, f"request body is not valid JSON: {first.get('msg', '')}", code="invalid_json")
    field_error = (first.get("ctx") or {}).get("error")
    if isinstance(field_error, FieldError):  # a request-level check (types/request.py) that names its field
        return APIError(400, f"{field_error.param}: {field_error}", param=field_error.param, code="invalid_value")
    if tuple(first.get("loc", ())) == ("body",) and first.get("type") in _NOT_AN_OBJECT:
        return APIError(
            400, "request body must be a JSON object (Content-Type: application/json)", code="invalid_body"
        )
    param = _loc_to_param(first.get("loc", ()))
    msg = str(first.get("msg", "invalid value"))
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, ") :]
    message = f"{param}: {msg}" if param else msg
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
    return APIError(400, message, param=param, code="invalid_value")


def utf8_error(exc: UnicodeDecodeError) -> APIError:
    """A body that is not UTF-8: where the first bad byte is, and in which field when the rest parses."""
    raw = exc.object if isinstance(exc.object, bytes) else bytes(exc.object)
    where = f"byte 0x{raw[exc.start]:02x} at offset {exc.start}" if exc.start < len(raw) else "at the end"
    param = _field_of_bad_bytes(raw)
    message = f"request body is not valid UTF-8 ({where})"
    return APIError(400, f"{param}: {message}" if param else message, param=param, code="invalid_utf8")


def _field_of_bad_bytes(raw: bytes) -> str | None:
    from openalice_runner.server.validation import first_bad_string

    try:  # the bad bytes become lone surrogates, which the Unicode check finds by path
        parsed = json.loads(raw.decode("utf-8", errors="surrogateescape"))
    except ValueError:
        return None
    return first_bad_string(parsed, "") or None


def install_error_handlers(app: FastAPI) -> None:
    """Every error answered in the shape of the wire whose route was asked (server/wires/)."""
    from openalice_runner.server.wires import error_response

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(request.url.path, exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(request.url.path, validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if isinstance(exc.__cause__, UnicodeDecodeError):  # FastAPI's "error parsing the body"
            return error_response(request.url.path, utf8_error(exc.__cause__))
        code = {404: "not_found", 405: "method_not_allowed", 413: "body_too_large"}.get(exc.status_code)
        headers = dict(exc.headers) if exc.headers else None
        error = APIError(exc.status_code, str(exc.detail), code=code, headers=headers)
        return error_response(request.url.path, error)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        from openalice_runner.server.error_log import ERRORS

        ERRORS.report("unhandled error", exc, path=request.url.path)  # rate-limited; traceback once per kind
        return error_response(request.url.path, APIError(500, "internal error", code="internal_error"))
