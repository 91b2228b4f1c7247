"""The provider interface: where a chat request runs (the embedded engine, an SGLang or vLLM pool, a
hosted API; providers/registry.py builds each by its routing-file `type`).

Providers are composed by wrapping (WrapperProvider): fallback and tracing are wrappers, not code
inside every provider. Errors are typed so that a wrapper can tell "nothing was produced yet,
another provider may serve" (`fallback_ok`) from "the request itself is wrong" or "the stream
broke after tokens went out" (never retried).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Any

from openalice_runner.providers.streams import ChatStream
from openalice_runner.speculation import SpeculationPlan
from openalice_runner.types import ChatRequest, ChatResult


@dataclass(frozen=True)
class Capabilities:
    tools: bool = True
    streaming: bool = True
    spec_methods: frozenset[str] = frozenset({"off"})  # what this provider can realise


@dataclass(frozen=True)
class ProviderLoad:
    """Current load as the provider sees it; None means unknown."""

    batch_size: int | None = None  # requests being decoded now
    queue_depth: int | None = None  # requests waiting
    # the largest batch the provider decodes (SGLang's --max-running-requests): a request that
    # arrives when it is full waits, so the batch it joins is no larger
    max_batch: int | None = None
    # the provider reads its servers' load and could read none: the policy sees an unknown batch
    # size, never batch 1 (providers that do not read load leave it False)
    unknown: bool = False

    @property
    def total(self) -> int | None:
        if self.batch_size is None and self.queue_depth is None:
            return None
        return (self.batch_size or 0) + (self.queue_depth or 0)


#: CallContext.attributes key under which a caller may pass the OpenTelemetry context to parent the call
#: span on (the sidecar does: its turn spans live across requests, not in the current context).
OTEL_CONTEXT_KEY = "otel_context"


@dataclass
class CallContext:
    """Who is asking: the turn's identity and the policy's plan for this one call."""

    conversation_id: str | None = None
    turn_type: str = "chat"
    step: int = 0
    agent: str | None = None
    plan: SpeculationPlan | None = None  # γ by batch size included (`per_batch`)
    model: str | None = None
    attributes: dict[str, Any] = field(default_factory=dict)
    # whose key the request came with (`serve --keys`/`--api-key`); None: an open server, one shared
    # tenant. Providers keep what one request leaves behind (drafter stores, prefix caches,
    # histories, γ statistics) per tenant, and a conversation id is scoped by it (`scoped_conversation`).
    tenant: str | None = None
    parse_s: float | None = None  # the server's reading and validating of the request's body (None: no server)

    @property
    def scoped_conversation(self) -> str | None:
        """The conversation id as a state key: the same id from two tenants names two conversations."""
        return scoped_conversation(self.tenant, self.conversation_id)


def scoped_conversation(tenant: str | None, conversation_id: str | None) -> str | None:
    if conversation_id is None or tenant is None:
        return conversation_id
    # unambiguous: a tenant name holds no ':' (server/tenants/tenant.py); and a server with keys gives
    # every request a tenant, so an unscoped id never meets a scoped one
    return f"{tenant}:{conversation_id}"


# ---------------------------------------------------------------- errors


class ProviderError(Exception):
    """A provider failed. `fallback_ok`: nothing was produced and another provider may serve."""

    fallback_ok = False

    def __init__(
        self,
        message: str,
        *,
        provider: str | None = None,
        status_code: int | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.provider = provider
        self.status_code = status_code
        self.retry_after = retry_after

    def __str__(self) -> str:
        where = f"[{self.provider}] " if self.provider else ""
        code = f" (HTTP {self.status_code})" if self.status_code else ""
        return f"{where}{self.message}{code}"


class ProviderUnavailable(ProviderError):
    """Connection refused, 5xx, or a timeout before the first token: fallback allowed."""

    fallback_ok = True


class ProviderTimeout(ProviderUnavailable):
    """No first token (or no response) within the configured timeout."""


class ProviderBadResponse(ProviderUnavailable):
    """Upstream answered 200 with a body the runner cannot read (a required field missing or
    mistyped). Before the first token this falls back like a 5xx; `code` names the failure."""

    code = "bad_response"


class ProviderInternalError(ProviderUnavailable):
    """The provider itself failed (an embedded engine's bug, not the request's input): reported as
    a 500 that says so, its traceback logged where it was raised. Before the first token another
    provider may serve; `code` names the failure."""

    code = "internal_error"


class ProviderRateLimited(ProviderError):
    """429 from upstream. Nothing was produced, so another provider may serve."""

    fallback_ok = True


class ProviderBadRequest(ProviderError):
    """The request itself is invalid for this provider (4xx other than 429): never retried.
    `param` names the request field at fault and `code` says what is wrong, when known
    (e.g. "messages" / "context_length_exceeded")."""

    def __init__(
        self, message: str, *, param: str | None = None, code: str | None = None, **kwargs: Any
    ) -> None:
        kwargs.setdefault("status_code", 400)
        super().__init__(message, **kwargs)
        self.param = param
        self.code = code


class StreamBroken(ProviderError):
    """The stream failed after its first token went out: reported, never retried silently."""


class NoProviderAvailable(ProviderUnavailable):
    """Every provider of a fallback chain failed before its first token."""

    def __init__(self, message: str, errors: list[ProviderError], **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.errors = errors


# ---------------------------------------------------------------- the interface


class Provider(ABC):
    """One place a request can run. Subclasses set `name` and `capabilities`."""

    name: str = "provider"
    kind: str = "provider"  # local | sglang | vllm | hosted: the routing-file `type` (admission gates read it)
    gen_ai_provider_name: str = "openalice"  # OpenTelemetry gen_ai.provider.name
    capabilities: Capabilities = Capabilities()

    @abstractmethod
    async def chat(self, request: ChatRequest, ctx: CallContext) -> ChatResult: ...

    @abstractmethod
    def stream(self, request: ChatRequest, ctx: CallContext) -> AbstractAsyncContextManager[ChatStream]:
        """`async with provider.stream(request, ctx) as chunks: async for chunk in chunks: ...`; the
        last chunk carries finish_reason and usage. Leaving the block, however it is left, stops the
        generation (providers/streams.py)."""

    def precheck(self, request: ChatRequest) -> None:  # noqa: B027 - optional hook
        """Refuse at once (ProviderBadRequest) a request this provider can never serve, before it
        queues for a slot. Cheap and synchronous; the full checks still run when the request does."""

    def load(self) -> ProviderLoad:
        """Cheap, synchronous, never does I/O: the last known load."""
        return ProviderLoad()

    async def current_load(self) -> ProviderLoad:
        """Load fresh enough to decide on; may refresh a cache (SGLang reads its servers)."""
        return self.load()

    def pool_load(self, pool: str) -> ProviderLoad | None:
        """The last known load of one pool (SGLang, vLLM); None where the provider has no such pool."""
        return None

    @property
    def model_names(self) -> list[str]:
        return []

    @property
    def model_name(self) -> str | None:
        """The model this provider serves by default (tracing names the call after it)."""
        names = self.model_names
        return names[0] if names else None

    async def ensure_loaded(self) -> None:  # noqa: B027 - optional hook
        """Load what the first request would otherwise wait for (an embedded model's weights)."""

    @property
    def kv_tokens_in_use(self) -> int | None:
        """KV-cache tokens held by an embedded engine; None where the provider holds none."""
        return None

    async def aclose(self) -> None:  # noqa: B027 - optional hook
        pass

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"
