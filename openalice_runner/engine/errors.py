"""The engine's one family of client input errors.

The engine raises `InvalidRequest` where it checks what a request asks for: a prompt past the
context, a sampling value out of range, a schema or grammar that cannot be compiled. Anything else
the engine raises (a ValueError included) is a fault of ours: providers/local.py reports it as an
internal error (500, eligible for fallback), never as the client's mistake. Torch-free, so that
providers/local.py can import it before the engine loads.
"""

from __future__ import annotations


class InvalidRequest(ValueError):
    """The request's own input is wrong and resending it unchanged fails again: the client's to fix.

    `param` names the request field at fault where the engine knows it (OpenAI's dotted path, e.g.
    "top_p", "messages", "response_format"); `code` says what is wrong (OpenAI's error code).
    A ValueError, so that callers that caught ValueError still catch it."""

    default_param: str | None = None
    default_code: str = "invalid_value"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param if param is not None else self.default_param
        self.code = code if code is not None else self.default_code


class ContextLengthError(InvalidRequest):
    """The prompt does not fit the model's context window."""

    default_param = "messages"
    default_code = "context_length_exceeded"
