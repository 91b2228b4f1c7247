"""The one mapping of an engine exception to the provider's errors, for plain and streamed calls alike.

The engine's exception classes are the engine's (only providers/local.py imports it): local.py hands
them in as an `EngineErrors`."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from openalice_runner.providers.base import (
    ProviderBadRequest,
    ProviderError,
    ProviderInternalError,
    ProviderRateLimited,
    StreamBroken,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineErrors:
    """The engine's exception classes the mapping tells apart."""

    overloaded: type[Exception]  # its waiting line is full (engine/types.py's EngineOverloaded)
    invalid: type[Exception]  # its checks of the request (engine/errors.py's InvalidRequest: param, code)

    def provider_error(self, exc: Exception, provider: str, *, started: bool) -> ProviderError:
        """Overload is 429, the engine's checks of the request are the client's (400), anything else
        is ours (500); once a stream has sent chunks, both of the latter break it instead."""
        if isinstance(exc, self.overloaded):
            return ProviderRateLimited(str(exc), provider=provider)
        if isinstance(exc, self.invalid):
            return StreamBroken(str(exc), provider=provider) if started else bad_request(exc, provider)
        if started:
            logger.error("%s: engine failed mid-stream", provider, exc_info=exc)
            return StreamBroken(f"engine failed mid-stream ({type(exc).__name__})", provider=provider)
        return internal(exc, provider)


def bad_request(exc: Exception, provider: str) -> ProviderBadRequest:
    """The engine's refusal of the request, naming the field it blames (`param`) and why (`code`)."""
    param: str | None = getattr(exc, "param", None)
    code: str | None = getattr(exc, "code", None)
    return ProviderBadRequest(str(exc), provider=provider, param=param, code=code)


def internal(exc: BaseException, provider: str) -> ProviderInternalError:
    """An engine fault: logged here with its traceback (the reply says only that it happened)."""
    logger.error("%s: engine fault", provider, exc_info=exc)
    return ProviderInternalError(f"engine fault ({type(exc).__name__}): {exc}", provider=provider, status_code=500)
