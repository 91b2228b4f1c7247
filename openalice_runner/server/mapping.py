"""Runner and provider exceptions -> API errors (status, OpenAI type/code), with no secrets in messages."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

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
from openalice_runner.providers.wrappers.admission import AdmissionRefused
from openalice_runner.redaction import redact
from openalice_runner.server.error_log import ERRORS
from openalice_runner.server.errors import APIError


def _retry_after(seconds: float | None) -> dict[str, str]:
    return {"Retry-After": str(max(1, round(seconds or 1)))}


def api_error_from(exc: BaseException, *, report: bool = True) -> APIError:
    """The API error a request answers with. `report`: an unexpected error (500 internal_error) goes to
    the error log; False where an error is only classified (a metric's outcome, a pre-check), not answered,
    so it is logged once, where it is answered."""
    error = _mapped(exc)
    error.message = redact(error.message)  # provider messages can echo keys
    if report and error.status_code >= 500 and error.code == "internal_error":
        ERRORS.report("request failed", exc)  # one line, the traceback once per distinct error
    return error


def _mapped(exc: BaseException) -> APIError:
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ValidationError):
        return _invalid_value(exc)
    if _names_unknown_model(exc):
        # OpenAI answers an unknown model with 404, type invalid_request_error, code model_not_found.
        return APIError(404, str(exc), param="model", code="model_not_found", type="invalid_request_error")
    if isinstance(exc, ProviderError):
        return _from_provider(exc)
    if isinstance(exc, asyncio.TimeoutError | TimeoutError):
        return APIError(504, "the request timed out", code="timeout")
    if isinstance(exc, ValueError):
        return APIError(400, str(exc), code="invalid_value")
    return APIError(500, "internal error", code="internal_error")


def _invalid_value(exc: ValidationError) -> APIError:
    errors = exc.errors()
    first: Mapping[str, Any] = errors[0] if errors else {}
    param = ".".join(str(p) for p in first.get("loc", ())) or None
    return APIError(400, f"{param}: {first.get('msg', 'invalid value')}", param=param, code="invalid_value")


def _names_unknown_model(exc: BaseException) -> bool:
    if type(exc).__name__ == "UnknownModelError":
        return True
    return isinstance(exc, LookupError) and "model" in str(exc).lower()


def _from_provider(exc: ProviderError) -> APIError:
    cause = _telling_cause(exc) if isinstance(exc, NoProviderAvailable) else None
    if cause is not None:
        return _mapped(cause)
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
        return _bad_request(exc)
    return APIError(502, f"provider error ({type(exc).__name__})", code="provider_error")


def _telling_cause(exc: NoProviderAvailable) -> ProviderError | None:
    """The one error of a failed chain that says what happened better than a 503, or None."""
    errors = exc.errors
    if not errors:
        return None
    if all(isinstance(e, ProviderRateLimited) for e in errors):
        # Every provider of the chain was full or rate limited: overload, which is a 429, not a 503.
        return min(errors, key=lambda e: e.retry_after or 0)
    if all(isinstance(e, ProviderTimeout) for e in errors):
        return errors[-1]  # all timed out: a 504 says so better than a 503
    if all(isinstance(e, ProviderInternalError) for e in errors):
        return errors[-1]  # every provider failed by a fault of its own: a 500
    return None


def _bad_request(exc: ProviderBadRequest) -> APIError:
    status = exc.status_code if exc.status_code and 400 <= exc.status_code < 500 else 400
    if status == 429:
        status = 400  # a 429 is ProviderRateLimited's; a "bad request" carrying one is still bad input
    return APIError(status, exc.message, param=exc.param, code=exc.code or "provider_rejected")
