"""What a pool request carries upstream: the body both dialects start from, the tenant's cache salt
and the conversation header a gateway routes by."""

from __future__ import annotations

import base64
import hashlib
from typing import Any

from openalice_runner.providers import openai_wire as wire
from openalice_runner.providers.base import CallContext
from openalice_runner.types import CONVERSATION_HEADER, AllowedToolChoice, ChatRequest

CACHE_SALT_DOMAIN = b"openalice-runner cache_salt v1\0"


def cache_salt(tenant: str) -> str:
    """The `cache_salt` a tenant's requests carry upstream: from its name (never its key), 256 bits as
    43 base64url characters, as vLLM's field asks (base64url: vLLM 0.32 refuses a salt with `/`).
    Derived, not random: every runner in front of the same pool gives a tenant the same salt, so its
    prefixes are shared across runners and restarts (the salt is a namespace, not a secret: clients
    reach the runner, never the pools directly)."""
    digest = hashlib.sha256(CACHE_SALT_DOMAIN + tenant.encode()).digest()
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def upstream_headers(ctx: CallContext) -> dict[str, str]:
    """The conversation id, sent on: a gateway in front of a pool's workers (smg `--policy
    consistent_hashing --routing-key-headers x-openalice-conversation-id`) keys each conversation
    to the worker that holds its prefix cache. Scoped by the tenant: the same id from two tenants is two
    conversations."""
    conversation = ctx.scoped_conversation
    return {CONVERSATION_HEADER: conversation} if conversation else {}


def request_body(request: ChatRequest, model: str, stream: bool, tenant: str | None = None) -> dict[str, Any]:
    """The OpenAI-shaped body both dialects start from (a dialect adds its own fields)."""
    body = wire.request_body(request, model)
    if tenant is not None:
        # vLLM's and SGLang's own per-request prefix-cache isolation: a tenant's cached prefixes
        # serve that tenant only (docs/security.md, "Tenants")
        body["cache_salt"] = cache_salt(tenant)
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    choice = request.tool_choice
    if isinstance(choice, AllowedToolChoice):
        # neither SGLang 0.5.23's nor vLLM 0.32's ChatCompletionRequest has the allowed_tools
        # form: the same calls, as only the allowed tools under the plain mode
        allowed = set(choice.allowed_tools.names)
        body["tools"] = [t for t in body["tools"] if t["function"]["name"] in allowed]
        body["tool_choice"] = choice.allowed_tools.mode
    return body
