"""Errors in OpenAI's shape for the Responses wire: `{"error": {"message", "type", "param", "code"}}`, the
param a dotted path into the body (`input[2].content[0].text`), the codes OpenAI's API uses
(`unknown_parameter`, `missing_required_parameter`, `invalid_type`, `invalid_value`)."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from openalice_runner.server.errors import APIError
from openalice_runner.types import FieldError


def invalid(param: str, message: str, code: str = "invalid_value", status: int = 400) -> APIError:
    return APIError(status, f"{param}: {message}", param=param, code=code)


def param_of(loc: tuple[Any, ...] | list[Any]) -> str:
    """pydantic's ('input', 'list[...]', 2, '@message', 'content') -> 'input[2].content'."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif isinstance(part, str) and not _is_member_name(part):
            out += f".{part}" if out else part
    return out


def _is_member_name(part: str) -> bool:
    """A union member or tag pydantic puts in a location: not a field name."""
    return (
        part.startswith("@")
        or part in ("str", "int", "bool", "float")
        or part.startswith(("list[", "dict[", "tagged-union[", "function-", "literal["))
    )


_CODES = {"missing": "missing_required_parameter", "extra_forbidden": "unknown_parameter"}


def from_validation(exc: ValidationError) -> APIError:
    """The most specific of pydantic's errors (the deepest: the branch of a union the value went
    furthest in), as OpenAI words it."""
    errors = exc.errors(include_url=False)
    if not errors:
        return APIError(400, "invalid request body", code="invalid_value")
    first = max(errors, key=lambda e: len(e.get("loc", ())))
    field_error = (first.get("ctx") or {}).get("error")
    if isinstance(field_error, FieldError):
        return invalid(field_error.param, str(field_error))
    param = param_of(first.get("loc", ()))
    kind = str(first.get("type", ""))
    if kind == "extra_forbidden":
        return APIError(400, f"Unknown parameter: '{param}'.", param=param, code="unknown_parameter")
    if kind == "missing":
        return APIError(
            400, f"Missing required parameter: '{param}'.", param=param, code="missing_required_parameter"
        )
    msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    code = "invalid_type" if kind.endswith("_type") else "invalid_value"
    return APIError(400, f"{param}: {msg}" if param else msg, param=param or None, code=code)
