"""A scripted provider, for tests of what sits around providers (routing, policy, fallback,
tracing, the server) that need no model: the reply comes from a function, as pydantic-ai's
`FunctionModel` gives one; the default echoes the last user message. Torch-free.

It reports a `SpeculationOutcome` like a real provider (the plan's method and γ, every draft
accepted), so the policy and tracing see figures, and records each request with its context.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable
from contextlib import AbstractAsyncContextManager

from openalice_runner import Runner
from openalice_runner.providers.base import CallContext, Capabilities, Provider
from openalice_runner.providers.config import RoutingConfig, load_routing_text
from openalice_runner.providers.streams import ChatStream, chat_stream
from openalice_runner.speculation import SpeculationOutcome
from openalice_runner.types import (
    ChatChunk,
    ChatRequest,
    ChatResult,
    ChunkChoice,
    SpeculationInfo,
    Usage,
    new_id,
)

Reply = Callable[[ChatRequest, CallContext], str]


def echo(request: ChatRequest, ctx: CallContext) -> str:
    users = [m for m in request.messages if m.role == "user"]
    return f"you said: {users[-1].text}" if users else "hello"


class ScriptedProvider(Provider):
    kind = "local"

    def __init__(self, name: str = "scripted", reply: Reply = echo, model: str = "scripted-model") -> None:
        self.name = name
        self.reply = reply
        self.model = model
        self.calls: list[tuple[ChatRequest, CallContext]] = []
        self.closed_streams = 0
        self.capabilities = Capabilities(spec_methods=frozenset({"off", "ngram", "draft", "eagle"}))

    @property
    def model_names(self) -> list[str]:
        return [self.model]

    def _words(self, request: ChatRequest, ctx: CallContext) -> list[str]:
        self.calls.append((request, ctx))
        words = self.reply(request, ctx).split(" ")
        return words[: request.max_tokens] if request.max_tokens else words

    def _outcome(self, ctx: CallContext, tokens: int) -> SpeculationOutcome:
        plan = ctx.plan
        if plan is None or not plan.speculates:
            return SpeculationOutcome(completion_tokens=tokens, target_passes=tokens, tokens_per_pass=1.0)
        rounds = max(1, tokens // (plan.gamma + 1))
        return SpeculationOutcome(
            method=plan.method, gamma=plan.gamma, completion_tokens=tokens, target_passes=rounds,
            proposed=rounds * plan.gamma, accepted=rounds * plan.gamma,
            accept_length_histogram=(0,) * plan.gamma + (rounds,), tokens_per_pass=tokens / rounds,
            rule=plan.rule, policy_version=plan.policy_version,
        )  # fmt: skip

    async def chat(self, request: ChatRequest, ctx: CallContext) -> ChatResult:
        words = self._words(request, ctx)
        outcome = self._outcome(ctx, len(words))
        finish = "length" if request.max_tokens and len(words) >= request.max_tokens else "stop"
        result = ChatResult.single(
            model=self.model, content=" ".join(words), finish_reason=finish,
            usage=Usage.of(len(request.messages), len(words)), speculation=SpeculationInfo.from_outcome(outcome),
            provider=self.name,
        )  # fmt: skip
        return result.attach_outcome(outcome)

    def stream(self, request: ChatRequest, ctx: CallContext) -> AbstractAsyncContextManager[ChatStream]:
        return chat_stream(self._chunks(request, ctx))

    async def _chunks(self, request: ChatRequest, ctx: CallContext) -> AsyncGenerator[ChatChunk, None]:
        try:
            words = self._words(request, ctx)
            chunk_id = new_id("chatcmpl")
            for i, word in enumerate(words):
                yield ChatChunk.text(chunk_id, self.model, word if i == 0 else " " + word, role=i == 0)
            outcome = self._outcome(ctx, len(words))
            finish = "length" if request.max_tokens and len(words) >= request.max_tokens else "stop"
            final = ChatChunk(
                id=chunk_id, model=self.model, choices=[ChunkChoice(finish_reason=finish)],
                usage=Usage.of(len(request.messages), len(words)), speculation=SpeculationInfo.from_outcome(outcome),
                provider=self.name,
            )  # fmt: skip
            yield final.attach_outcome(outcome)
        finally:
            self.closed_streams += 1


ROUTING = """\
providers:
  scripted: {type: hosted, model: scripted/model}
routes:
  - name: default
    chain: [scripted]
"""


def scripted_runner(provider: ScriptedProvider | None = None, **kwargs) -> Runner:
    """A Runner whose one provider is scripted (the routing names a hosted provider, which is never
    built: the scripted one stands in its place). kwargs: Runner's (policy, telemetry, admission)."""
    routing: RoutingConfig = load_routing_text(ROUTING)
    return Runner(routing, {"scripted": provider or ScriptedProvider()}, **kwargs)
