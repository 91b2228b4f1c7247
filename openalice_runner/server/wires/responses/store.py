"""Recent responses, kept for `previous_response_id`: bounded, per API key, in memory.

A response is kept when its request did not say `store: false` (OpenAI's default is to store). The
store keeps the conversation the response ends (its input and output as chat messages, without
`instructions`, which OpenAI does not carry over), so a request naming it continues from there. Keys
are the digest of the credential the request came with: one caller cannot continue another's
responses. The oldest go first past `max_entries`; an id not (or no longer) here is a 400
`previous_response_not_found`, never a silent fresh start.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Mapping

from openalice_runner.server.errors import APIError
from openalice_runner.types import ChatMessage


def credential_of(headers: Mapping[str, str]) -> str:
    """The digest of the caller's credential (bearer token or x-api-key); "" without one."""
    auth = headers.get("authorization") or ""
    token = auth[7:].strip() if auth[:7].lower() == "bearer " else headers.get("x-api-key", "")
    return hashlib.sha256(token.encode()).hexdigest() if token else ""


class ResponseStore:
    def __init__(self, max_entries: int = 1024) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[tuple[str, str], tuple[ChatMessage, ...]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, credential: str, response_id: str, conversation: list[ChatMessage]) -> None:
        self._entries[(credential, response_id)] = tuple(conversation)
        self._entries.move_to_end((credential, response_id))
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def get(self, credential: str, response_id: str) -> list[ChatMessage]:
        found = self._entries.get((credential, response_id))
        if found is None:
            raise APIError(
                400,
                f"Previous response with id '{response_id}' not found.",
                param="previous_response_id",
                code="previous_response_not_found",
            )
        self._entries.move_to_end((credential, response_id))
        return [m.model_copy(deep=True) for m in found]
