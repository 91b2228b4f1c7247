"""A conversation's token history, so that its next call's prompt starts with the very tokens the
engine holds.

A loop sends the model's reply back as text inside the next call's history, and the chat template
renders it again: re-tokenised, the text can split into other tokens than the ones the model
generated (a word's piece boundaries, a tool call rewritten from its parsed form), and the
engine's prefix reuse, which matches token ids, stops at the first such difference. So for each
conversation we keep the ids of its last call (prompt and reply) and, when the next prompt's text
starts with the same text, build the prompt from those ids up to the first character that
differs and tokenise only the rest. The text the model reads is the same; only its split into
tokens follows what the model itself produced.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

MAX_CONVERSATIONS = 256  # histories kept, least recently used dropped first


def _decode(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def align_prompt(tokenizer, held: list[int], prompt: list[int]) -> list[int]:
    """`prompt` re-split so that it starts with the longest run of `held` whose text it starts
    with; `prompt` itself where that gains nothing or the texts cannot be matched exactly."""
    same = 0
    for a, b in zip(held, prompt, strict=False):
        if a != b:
            break
        same += 1
    if same == len(held):
        return prompt
    text = _decode(tokenizer, prompt)
    # the longest k with decode(held[:k]) a prefix of the prompt's text (binary search: a longer
    # run's text extends a shorter one's, but for bytes of a character cut in two)
    lo, hi = same, len(held)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if text.startswith(_decode(tokenizer, held[:mid])):
            lo = mid
        else:
            hi = mid - 1
    if lo <= same:
        return prompt
    head = _decode(tokenizer, held[:lo])
    aligned = held[:lo] + tokenizer.encode(text[len(head):], add_special_tokens=False)
    # the model must read the same text: where the split cannot say so exactly, keep the prompt
    return aligned if _decode(tokenizer, aligned) == text else prompt


class ConversationHistories:
    """Per conversation id: the token ids of its last call, prompt and reply (thread-safe)."""

    def __init__(self, capacity: int = MAX_CONVERSATIONS) -> None:
        self.capacity = capacity
        self._ids: OrderedDict[str, list[int]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, conversation: str | None) -> list[int] | None:
        if conversation is None:
            return None
        with self._lock:
            ids = self._ids.get(conversation)
            if ids is not None:
                self._ids.move_to_end(conversation)
            return ids

    def put(self, conversation: str | None, ids: list[int]) -> None:
        if conversation is None:
            return
        with self._lock:
            self._ids[conversation] = list(ids)
            self._ids.move_to_end(conversation)
            while len(self._ids) > self.capacity:
                self._ids.popitem(last=False)

    def __len__(self) -> int:
        return len(self._ids)
