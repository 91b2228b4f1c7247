"""Recent responses, kept for `previous_response_id`: bounded, per API key, in memory.

A response is kept when its request did not say `store: false` (OpenAI's default is to store). The
store keeps the conversation the response ends (its input and output as chat messages, without
`instructions`, which OpenAI does not carry over), so a request naming it continues from there. Keys
are the digest of the credential the request came with: one caller cannot continue another's
responses. The oldest go first past `max_entries` or past `max_chars` of text in all (a conversation
is as long as the bodies the server takes, so a count alone would not bound the memory); an id not (or
no longer) here is a 400 `previous_response_not_found`, never a silent fresh start.
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


def _chars(conversation: tuple[ChatMessage, ...]) -> int:
    return sum(
        len(m.text) + sum(len(c.function.name) + len(c.function.arguments) for c in m.tool_calls or ())
        for m in conversation
    )


class ResponseStore:
    def __init__(self, max_entries: int = 1024, max_chars: int = 64 * 1024 * 1024) -> None:
        self.max_entries, self.max_chars = max_entries, max_chars
        self._entries: OrderedDict[tuple[str, str], tuple[tuple[ChatMessage, ...], int]] = OrderedDict()
        self._chars = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, credential: str, response_id: str, conversation: list[ChatMessage]) -> None:
        kept = tuple(conversation)
        size = _chars(kept)
        if size > self.max_chars:
            return  # larger than the whole store: kept, it would evict everything else
        key = (credential, response_id)
        old = self._entries.pop(key, None)
        if old is not None:
            self._chars -= old[1]
        self._entries[key] = (kept, size)
        self._chars += size
        while len(self._entries) > self.max_entries or self._chars > self.max_chars:
            _, (_, dropped) = self._entries.popitem(last=False)
            self._chars -= dropped

    def get(self, credential: str, response_id: str) -> list[ChatMessage]:
        entry = self._entries.get((credential, response_id))
        found = entry[0] if entry is not None else None
        if found is None:
            raise APIError(
                400,
                f"Previous response with id '{response_id}' not found.",
                param="previous_response_id",
                code="previous_response_not_found",
            )
        self._entries.move_to_end((credential, response_id))
        return [m.model_copy(deep=True) for m in found]
