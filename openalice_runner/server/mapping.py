"""Runner and provider exceptions -> API errors (status, OpenAI type/code), with no secrets in messages."""

from __future__ import annotations

import asyncio

from pydantic import ValidationError

from openalice_runner.providers.admission import AdmissionRefused
from openalice_runner.providers.base import (
    NoProviderAvailable,
    ProviderBadRequest,
    ProviderError,
    ProviderInternalError,
    ProviderRateLimited,
    ProviderTimeout,
    ProviderUnavailable,
    StreamBroken,
)
from openalice_runner.redaction import redact
from openalice_runner.server.errors import APIError


def _retry_after(seconds: float | None) -> dict[str, str]:
    return {"Retry-After": str(max(1, round(seconds or 1)))}


def api_error_from(exc: BaseException) -> APIError:
    error = _api_error_from(exc)
    error.message = redact(error.message)  # provider messages can echo keys
    return error


def _api_error_from(exc: BaseException) -> APIError:
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        param = ".".join(str(p) for p in first.get("loc", ())) or None
        return APIError(
            400, f"{param}: {first.get('msg', 'invalid value')}", param=param, code="invalid_value"
        )
    name = type(exc).__name__
    if name == "UnknownModelError" or isinstance(exc, LookupError) and "model" in str(exc).lower():
        # OpenAI answers an unknown model with 404, type invalid_request_error, code model_not_found.
        return APIError(404, str(exc), param="model", code="model_not_found", type="invalid_request_error")
    if (
        isinstance(exc, NoProviderAvailable)
        and exc.errors
        and all(isinstance(e, ProviderRateLimited) for e in exc.errors)
    ):
        # Every provider of the chain was full or rate limited: overload, which is a 429, not a 503.
        return _api_error_from(min(exc.errors, key=lambda e: e.retry_after or 0))
    if (
        isinstance(exc, NoProviderAvailable)
        and exc.errors
        and all(isinstance(e, ProviderTimeout) for e in exc.errors)
    ):
        return _api_error_from(exc.errors[-1])  # all timed out: a 504 says so better than a 503
    if (
        isinstance(exc, NoProviderAvailable)
        and exc.errors
        and all(isinstance(e, ProviderInternalError) for e in exc.errors)
    ):
        return _api_error_from(exc.errors[-1])  # every provider failed by a fault of its own: a 500
    if isinstance(exc, AdmissionRefused):
        return APIError(429, f"server busy ({exc.provider}: {exc.message}); retry later", code="server_busy",
                        headers=_retry_after(exc.retry_after))  # fmt: skip
    if isinstance(exc, ProviderRateLimited):
        return APIError(429, "upstream provider is rate limiting; retry later", code="rate_limited",
                        headers=_retry_after(exc.retry_after))  # fmt: skip
    if isinstance(exc, ProviderInternalError):
        # the details (and traceback) are in the log where it was raised, not in the reply
        return APIError(500, f"internal error in provider {exc.provider or '?'}: the request did not fail "
                        "by its input; see the server log", code="internal_error")  # fmt: skip
    if isinstance(exc, ProviderTimeout):
        return APIError(504, "the provider did not answer in time", code="provider_timeout")
    if isinstance(exc, ProviderUnavailable):
        return APIError(503, "no provider could serve the request", code="provider_unavailable",
                        headers=_retry_after(exc.retry_after))  # fmt: skip
    if isinstance(exc, StreamBroken):
        return APIError(502, "the provider's stream broke after it started", code="stream_broken")
    if isinstance(exc, ProviderBadRequest):
        status = exc.status_code if exc.status_code and 400 <= exc.status_code < 500 else 400
        if status == 429:
            status = 400  # a 429 is ProviderRateLimited's; a "bad request" carrying one is still bad input
        return APIError(status, exc.message, param=exc.param, code=exc.code or "provider_rejected")
    if isinstance(exc, ProviderError):
        return APIError(502, f"provider error ({type(exc).__name__})", code="provider_error")
    if isinstance(exc, asyncio.TimeoutError | TimeoutError):
        return APIError(504, "the request timed out", code="timeout")
    if isinstance(exc, ValueError):
        return APIError(400, str(exc), code="invalid_value")
    return APIError(500, "internal error", code="internal_error")
