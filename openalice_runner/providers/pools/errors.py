"""A pool server's HTTP errors as the runner's ProviderErrors: an error response (`http_error`) or an
error event inside a stream (`error_from_body`), in the OpenAI shape SGLang and vLLM both answer with."""

from __future__ import annotations

from typing import Any

import httpx

from openalice_runner.providers import openai_wire as wire
from openalice_runner.providers.base import (
    ProviderBadRequest,
    ProviderError,
    ProviderRateLimited,
    ProviderTimeout,
    ProviderUnavailable,
)


class NextReplica(Exception):
    """This replica failed before anything went out: mark it down, try the next."""


def _error_object(data: dict[str, Any]) -> dict[str, Any]:
    """The OpenAI-style {"error": {...}} inside a JSON error body, else the body itself."""
    error = data.get("error")
    return error if isinstance(error, dict) else data


def error_message(resp: httpx.Response) -> str:
    try:
        data = resp.json()
    except ValueError:
        return resp.text[:200]
    if isinstance(data, dict):
        inner = _error_object(data)
        return str(inner.get("message") or inner.get("detail") or data)[:500]
    return str(data)[:200]


def error_param(resp: httpx.Response) -> str | None:
    try:
        data = resp.json()
    except ValueError:
        return None
    if isinstance(data, dict):
        inner = _error_object(data)
        param = inner.get("param")
        return str(param) if param else None
    return None


def http_error(resp: httpx.Response, provider: str, param: str | None = None) -> ProviderError:
    message = error_message(resp)
    code = resp.status_code
    if code == 429:
        return ProviderRateLimited(
            message, provider=provider, status_code=code, retry_after=wire.retry_after(resp.headers)
        )
    if code in (408, 504):
        return ProviderTimeout(message, provider=provider, status_code=code)
    if code >= 500:
        return ProviderUnavailable(message, provider=provider, status_code=code)
    return ProviderBadRequest(message, provider=provider, status_code=code, param=param or error_param(resp))


def error_from_body(err: Any, provider: str) -> ProviderError:
    if not isinstance(err, dict):
        return ProviderUnavailable(str(err), provider=provider)
    message = str(err.get("message") or err)
    try:
        code = int(err.get("code") or 500)
    except (TypeError, ValueError):
        code = 500
    if code == 429:
        return ProviderRateLimited(message, provider=provider, status_code=code)
    if code >= 500:
        return ProviderUnavailable(message, provider=provider, status_code=code)
    return ProviderBadRequest(message, provider=provider, status_code=code, param=err.get("param") or None)
