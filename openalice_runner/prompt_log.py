"""Saved traffic: the prompts the runner serves, as JSON lines that `draft train --data` reads.

An EAGLE head pays only where it is aligned with the real traffic, so the operator can have the
runner keep its requests' prompts (`serve --log-prompts FILE`, `Runner.from_config(prompt_log=)`)
and later train the head on them. Off unless asked for: prompts are the users' data. The file is
created readable by its owner only, grows to a size cap and then stops (with one warning), and a
write that fails is logged and never fails the request. Replies are not kept: distillation asks
the target for its own.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path

from openalice_runner.types import ChatRequest

logger = logging.getLogger(__name__)

DEFAULT_MAX_BYTES = 256 * 1024 * 1024


class PromptLog:
    def __init__(self, path: str | Path, max_bytes: int = DEFAULT_MAX_BYTES):
        if max_bytes < 1:
            raise ValueError(f"prompt log max_bytes must be >= 1, got {max_bytes}")
        self.path = Path(path).expanduser()
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._full = False
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # owner-only from the first byte (os.open applies the mode when it creates the file)
        os.close(os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600))
        self.written = 0  # lines this process wrote

    def record(self, request: ChatRequest, turn_type: str) -> None:
        line: dict = {"messages": request.message_dicts(), "turn_type": turn_type}
        tools = request.tool_dicts()
        if tools:
            line["tools"] = tools
        if request.model:
            line["model"] = request.model
        data = (json.dumps(line, ensure_ascii=False) + "\n").encode()
        with self._lock:
            if self._full:
                return
            try:
                if self.path.stat().st_size + len(data) > self.max_bytes:
                    self._full = True
                    logger.warning("prompt log %s reached %d bytes: no more prompts are saved", self.path,
                                   self.max_bytes)
                    return
                with open(self.path, "ab") as f:
                    f.write(data)
                self.written += 1
            except OSError as exc:
                logger.warning("prompt log %s: %s (the request goes on)", self.path, exc)
