"""Saved traffic: the prompts the runner serves, as JSON lines that `draft train --data` reads.

An EAGLE head pays only where it is aligned with the real traffic, so the operator can have the
runner keep its requests' prompts (`serve --log-prompts FILE`, `Runner.from_config(prompt_log=)`)
and later train the head on them. Off unless asked for: prompts are the users' data. The file is
owner-only (0600, forced on an existing file; a symbolic link or another user's file is refused:
private_file.py), grows to a size cap and then stops (with one warning), and a write that fails is
logged and never fails the request. Only requests that produced a completion are kept (the Runner
records after the answer): a refused or failed request is no traffic to train on. Replies are not
kept: distillation asks the target for its own.

One entry is at most MAX_ENTRY_BYTES (256 KiB): about 64k tokens, more than any context the runner
serves, so a longer prompt could not have been served whole anyway, and one client cannot take a
large share of the log's cap with a single request. A longer entry keeps its first messages up to
the cap (the one that crosses it cut short) and says so: `"truncated": {"original_bytes": N}`.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path
from typing import Any

from openalice_runner.private_file import PrivateFileError, open_private_append
from openalice_runner.types import ChatRequest

logger = logging.getLogger(__name__)

DEFAULT_MAX_BYTES = 256 * 1024 * 1024
MAX_ENTRY_BYTES = 256 * 1024
MAX_MODEL_CHARS = 256  # an entry's `model`: a name longer than this was never a model's (types.MAX_MODEL_NAME)
_WHAT = "prompt log"


class PromptLog:
    def __init__(self, path: str | Path, max_bytes: int = DEFAULT_MAX_BYTES, max_entry_bytes: int = MAX_ENTRY_BYTES):
        if max_bytes < 1:
            raise ValueError(f"prompt log max_bytes must be >= 1, got {max_bytes}")
        if max_entry_bytes < 1024:
            raise ValueError(f"prompt log max_entry_bytes must be >= 1024, got {max_entry_bytes}")
        self.path = Path(path).expanduser()
        self.max_bytes = max_bytes
        self.max_entry_bytes = max_entry_bytes
        self._lock = threading.Lock()
        self._full = False
        # Checked now, so a bad path is an error at start-up (PrivateFileError names it), not a warning later.
        os.close(open_private_append(self.path, _WHAT))
        self.written = 0  # lines this process wrote

    def record(self, request: ChatRequest, turn_type: str) -> None:
        line: dict = {"messages": request.message_dicts(), "turn_type": turn_type}
        tools = request.tool_dicts()
        if tools:
            line["tools"] = tools
        if request.model:  # bounded by the request's schema; cut here too, whoever built the request
            line["model"] = request.model[:MAX_MODEL_CHARS]
        data = _capped(line, self.max_entry_bytes)
        with self._lock:
            if self._full:
                return
            try:
                # Opened afresh each time, through the same checks: a path swapped for a link since is refused.
                fd = open_private_append(self.path, _WHAT)
                try:
                    if os.fstat(fd).st_size + len(data) > self.max_bytes:
                        self._full = True
                        logger.warning("prompt log %s reached %d bytes: no more prompts are saved", self.path,
                                       self.max_bytes)
                        return
                    os.write(fd, data)
                finally:
                    os.close(fd)
                self.written += 1
            except (OSError, PrivateFileError) as exc:
                logger.warning("prompt log %s: %s (the request goes on)", self.path, exc)


def _dumps(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False).encode()


def _capped(line: dict, cap: int) -> bytes:
    """The entry as one JSON line of at most `cap` bytes (newline included)."""
    data = _dumps(line) + b"\n"
    if len(data) <= cap:
        return data
    head = {k: v for k, v in line.items() if k not in ("messages", "tools")}
    head["truncated"] = {"original_bytes": len(data)}
    budget = cap - len(_dumps({**head, "messages": [], "tools": []})) - 8
    tools = line.get("tools")
    if tools and len(_dumps(tools)) <= budget // 4:  # tools only when they leave room for the prompt
        head["tools"] = tools
        budget -= len(_dumps(tools))
    messages: list[dict] = []
    for message in line["messages"]:
        size = len(_dumps(message)) + 2
        if size <= budget:
            messages.append(message)
            budget -= size
            continue
        content = message.get("content")
        if isinstance(content, str):
            room = budget - (size - len(_dumps(content)))
            while room > 0:
                cut = {**message, "content": content.encode()[:room].decode(errors="ignore")}
                if len(_dumps(cut)) + 2 <= budget:
                    messages.append(cut)
                    break
                room -= max(16, (len(_dumps(cut)) + 2 - budget) * 2)  # JSON escapes took more room
        break
    out = _dumps({**head, "messages": messages}) + b"\n"
    return out if len(out) <= cap else _dumps({**head, "messages": []}) + b"\n"
