"""Blocking facade over the Runner (`runner.sync()`): the same Runner, driven on a private event loop
in a daemon thread."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Coroutine, Iterator
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

from openalice_runner.providers.base import CallContext
from openalice_runner.turn import MessagesArg, ToolStep, Turn
from openalice_runner.types import ChatChunk, ChatRequest, ChatResult

if TYPE_CHECKING:
    from openalice_runner.runner import Runner

_T = TypeVar("_T")


class SyncRunner:
    """Blocking facade: the Runner runs on a private event loop in a daemon thread."""

    def __init__(self, runner: Runner) -> None:
        self.runner = runner
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="openalice-runner-loop", daemon=True
        )
        self._thread.start()

    @classmethod
    def from_config(cls, *args: Any, **kwargs: Any) -> SyncRunner:
        """`Runner.from_config`'s arguments, forwarded as they are."""
        from openalice_runner.runner import Runner

        return cls(Runner.from_config(*args, **kwargs))

    def _run(self, coro: Coroutine[Any, Any, _T]) -> _T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def chat(self, request: ChatRequest, ctx: CallContext | None = None) -> ChatResult:
        return self._run(self.runner.chat(request, ctx))

    def turn(
        self, conversation_id: str | None = None, turn_type: str = "chat", agent: str | None = None
    ) -> SyncTurn:
        return SyncTurn(self, Turn(self.runner, conversation_id, turn_type, agent, attach_context=False))

    def close(self) -> None:
        if self._loop.is_closed():
            return
        self._run(self.runner.aclose())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    def __enter__(self) -> SyncRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SyncTurn:
    def __init__(self, sync: SyncRunner, turn: Turn) -> None:
        self._sync = sync
        self.turn = turn

    @property
    def step(self) -> int:
        return self.turn.step

    def __enter__(self) -> SyncTurn:
        self._sync._run(self.turn.__aenter__())
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._sync._run(self.turn.__aexit__(exc_type, exc, tb))

    def chat(self, messages: MessagesArg, **kwargs: Any) -> ChatResult:
        """`Turn.chat`, blocking; `kwargs` are its keyword arguments, forwarded."""
        return self._sync._run(self.turn.chat(messages, **kwargs))

    def stream(self, messages: MessagesArg, **kwargs: Any) -> Iterator[ChatChunk]:
        """`Turn.stream`, blocking; `kwargs` are its keyword arguments, forwarded."""
        chunks = self.turn.stream(messages, **kwargs)

        async def next_chunk() -> ChatChunk | None:
            # StopAsyncIteration cannot cross a future: None stands for the end (a stream yields no None).
            try:
                return await anext(chunks)
            except StopAsyncIteration:
                return None

        try:
            while (chunk := self._sync._run(next_chunk())) is not None:
                yield chunk
        finally:
            self._sync._run(chunks.aclose())  # stops the generation when the caller stops reading

    @contextlib.contextmanager
    def tool(self, name: str, call_id: str | None = None, arguments: object = None) -> Iterator[ToolStep]:
        cm = self.turn.tool(name, call_id, arguments)
        step = self._sync._run(cm.__aenter__())
        try:
            yield step
        except BaseException as exc:
            if not self._sync._run(cm.__aexit__(type(exc), exc, exc.__traceback__)):
                raise
        else:
            self._sync._run(cm.__aexit__(None, None, None))
