"""The Runner: the agentic loop's model backend.

    runner = Runner.from_config()                       # embedded default model
    async with runner.turn(conversation_id="c1", turn_type="tool_call", agent="alice") as turn:
        result = await turn.chat(messages, tools=tools)
        async with turn.tool("get_weather", call_id=result.tool_calls[0].id):
            ...                                         # the loop runs its tool here
        async for chunk in turn.stream(messages): ...
    await runner.aclose()

Per call: the route (turn type, model) names a fallback chain; each provider in it is wrapped as
AdmittedProvider(PolicyProvider(InstrumentedProvider(provider))): the provider's admission gate
holds a slot for the call or refuses it at once when its queue is full, the policy decides
speculation for the provider that will serve, with its current load as batch size, tracing records
the call, and the fallback moves on only before the first token. The sidecar calls `runner.chat` / `runner.stream` directly.
Sync code uses `SyncRunner` (`runner.sync()`), which drives the same Runner on a private loop thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import threading
from collections.abc import AsyncGenerator, AsyncIterator, Coroutine, Iterator, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from contextvars import Token
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal, TypeAlias, TypeVar

from openalice_runner.providers.base import OTEL_CONTEXT_KEY, CallContext, Provider
from openalice_runner.providers.config import (
    CATCH_ALL_MODEL,
    ProviderConfig,
    Route,
    RoutingConfig,
    load_routing_file,
)
from openalice_runner.providers.streams import ChatStream, chat_stream
from openalice_runner.providers.wrappers.admission import (
    AdmissionGate,
    AdmissionLimits,
    AdmissionRefused,
    AdmittedProvider,
)
from openalice_runner.providers.wrappers.fallback import FallbackProvider
from openalice_runner.providers.wrappers.policy import PolicyProvider
from openalice_runner.speculation import SpeculationPolicy
from openalice_runner.types import (
    ChatChunk,
    ChatMessage,
    ChatRequest,
    ChatResult,
    ToolDefinition,
    coerce_messages,
)

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.metrics import MeterProvider
    from opentelemetry.trace import Span, TracerProvider
    from pydantic import BaseModel

    from openalice_runner.policies import PolicyStore
    from openalice_runner.prompt_log import PromptLog
    from openalice_runner.tracing import RunnerTelemetry

logger = logging.getLogger(__name__)

_T = TypeVar("_T")


class PolicySetting(enum.Enum):
    """`Runner.from_config(policy=...)` when it is neither a file nor a PolicyStore."""

    DEFAULT = "default"  # the policy shipped in the package (openalice_runner/defaults/policy.yaml)
    OFF = "off"  # no policy: every call runs without speculation


DEFAULT_POLICY = PolicySetting.DEFAULT
NO_POLICY = PolicySetting.OFF

# What `from_config` takes as its policy. None and False are the older spellings of DEFAULT_POLICY
# and NO_POLICY, still accepted.
PolicyArg: TypeAlias = "str | Path | SpeculationPolicy | PolicySetting | None | Literal[False]"

# An engine for the `local` providers: an openalice_runner.engine.Engine, typed `object` here so
# that the core never imports the engine.
EngineArg: TypeAlias = object | None

# What the loop passes as messages, tools and tool_choice: OpenAI-shaped dicts or the models.
MessagesArg: TypeAlias = "ChatRequest | Sequence[ChatMessage | Mapping[str, Any]]"
ToolsArg: TypeAlias = "Sequence[ToolDefinition | Mapping[str, Any]] | None"
ToolChoiceArg: TypeAlias = "str | Mapping[str, Any] | None"
ResponseFormatArg: TypeAlias = "type[BaseModel] | Mapping[str, Any] | None"


def policy_setting(policy: PolicyArg) -> str | Path | SpeculationPolicy | PolicySetting:
    """`policy` with the older spellings read: None is DEFAULT_POLICY, False is NO_POLICY."""
    if policy is None:
        return PolicySetting.DEFAULT
    if policy is False:
        return PolicySetting.OFF
    return policy


def build_provider(name: str, config: ProviderConfig, engine: EngineArg = None) -> Provider:
    """Provider instance for one entry of the routing config (imports only what that type needs)."""
    if config.type == "local":
        from openalice_runner.providers.embedded.provider import EmbeddedProvider

        return EmbeddedProvider(name, config, engine=engine)
    if config.type == "sglang":
        from openalice_runner.providers.pools.sglang.provider import SGLangProvider

        return SGLangProvider(name, config)
    if config.type == "vllm":
        from openalice_runner.providers.pools.vllm.provider import VLLMProvider

        return VLLMProvider(name, config)
    if config.type == "hosted":
        from openalice_runner.providers.hosted import HostedProvider

        return HostedProvider(name, config)
    raise ValueError(f"unknown provider type {config.type!r}")


class Runner:
    def __init__(
        self,
        routing: RoutingConfig,
        providers: dict[str, Provider],
        policy: SpeculationPolicy | None = None,
        telemetry: RunnerTelemetry | None = None,
        admission: AdmissionLimits | None = None,
    ) -> None:
        self.routing = routing
        self.providers = providers  # name -> the bare provider
        self.policy = policy  # None: no policy (from_config resolves the default policy to a store)
        self.telemetry = telemetry
        # One gate per provider, shared by every route naming it. `admission`: defaults for the limits
        # a provider's own config leaves unset (the server's flags).
        self._admission = admission
        self._built_from = dict(routing.providers)  # name -> the config each provider was built from
        self.gates = {
            name: AdmissionGate.for_provider(
                name, provider.kind, _limits_of(routing.providers.get(name)).over(admission)
            )
            for name, provider in providers.items()
        }
        self._chains = {route.name: self._chain(route.chain) for route in routing.routes}
        self._owns_policy_watch = False
        self.prompt_log: PromptLog | None = None  # saved traffic for `draft train`

    # ---- construction ----

    @classmethod
    def from_config(
        cls,
        providers: str | Path | RoutingConfig | None = None,
        policy: PolicyArg = DEFAULT_POLICY,
        tracer_provider: TracerProvider | None = None,
        meter_provider: MeterProvider | None = None,
        *,
        telemetry: RunnerTelemetry | Literal[False] | None = None,
        watch_policy: bool = False,
        engine: EngineArg = None,
        record_content: bool = False,
        admission: AdmissionLimits | None = None,
        prompt_log: str | Path | None = None,
    ) -> Runner:
        """Build from a routing file (None: embedded default) and a policy.

        policy: a policy file, a PolicyStore, `DEFAULT_POLICY` (the default: the policy shipped in the
        package, openalice_runner/defaults/policy.yaml, a copy of policies/default.yaml) or `NO_POLICY`
        (no policy, speculation off). The older spellings still work: None means DEFAULT_POLICY and
        False means NO_POLICY. telemetry False: no tracing; None: a
        RunnerTelemetry on the given (or the global OpenTelemetry) providers. engine: an Engine
        for every `local` provider (tests and benchmarks pass a tiny one). prompt_log: a JSON-lines
        file that keeps every request's prompt, for `draft train --data` (off by default).
        """
        if providers is None:
            routing = RoutingConfig.default()
        elif isinstance(providers, RoutingConfig):
            routing = providers
        else:
            routing = load_routing_file(providers)
            _check_pools(policy_setting(policy), providers)
        store = _policy_store(policy_setting(policy), watch_policy)
        if telemetry is None:
            from openalice_runner.tracing import RunnerTelemetry

            telemetry = RunnerTelemetry(tracer_provider, meter_provider, record_content=record_content)
        elif telemetry is False:
            telemetry = None
        built = {name: build_provider(name, cfg, engine) for name, cfg in routing.providers.items()}
        runner = cls(routing, built, policy=store, telemetry=telemetry, admission=admission)
        runner._owns_policy_watch = watch_policy and store is not None
        if prompt_log is not None:
            from openalice_runner.prompt_log import PromptLog

            runner.prompt_log = PromptLog(prompt_log)
        return runner

    def _chain(self, names: list[str]) -> FallbackProvider:
        wrapped: list[Provider] = []
        for name in names:
            provider = self.providers[name]
            if self.telemetry is not None:
                from openalice_runner.providers.wrappers.instrumented import InstrumentedProvider

                provider = InstrumentedProvider(provider, self.telemetry)
            if self.policy is not None:
                provider = PolicyProvider(provider, self.policy, name)
            wrapped.append(AdmittedProvider(provider, self.gates[name]))
        return FallbackProvider(wrapped)

    # ---- what the sidecar calls ----

    def model_names(self) -> list[str]:
        names: list[str] = []
        for route in self.routing.routes:
            names += [n for n in route.match.models or [] if n != CATCH_ALL_MODEL]
        for provider in self.providers.values():
            names += provider.model_names
        return list(dict.fromkeys(names))

    def route_for(self, turn_type: str, model: str | None) -> Route:
        """The route of a request; UnknownModelError when no route takes its model name."""
        served_by = {name: provider.model_names for name, provider in self.providers.items()}
        return self.routing.route_for(turn_type, model, served_by)

    def chain_for(self, turn_type: str, model: str | None) -> FallbackProvider:
        return self._chains[self.route_for(turn_type, model).name]

    def apply_routing(self, routing: RoutingConfig) -> list[str]:
        """Apply an edited routing config live, as far as that is safe with requests running: routes
        and admission limits change at once, new providers are added. A provider whose definition
        changed (type, model, URLs, keys) is not swapped under its running requests: it keeps its old
        definition, and its name is returned as needing a restart."""
        needs_restart, added, resized = [], {}, {}
        for name, config in routing.providers.items():  # first build, so a failure changes nothing
            limits = _limits_of(config).over(self._admission)
            if name not in self.providers:
                provider = build_provider(name, config)
                added[name] = (provider, AdmissionGate.for_provider(name, provider.kind, limits))
            elif name in self._built_from and _definition(self._built_from[name]) != _definition(config):
                needs_restart.append(name)
                routing.providers[name] = self._built_from[name]
            else:
                resized[name] = AdmissionGate.for_provider(name, self.providers[name].kind, limits)
        for name, (provider, gate) in added.items():
            self.providers[name], self.gates[name] = provider, gate
            self._built_from[name] = routing.providers[name]
        for name, fresh in resized.items():
            self.gates[name].resize(fresh.max_in_flight, fresh.max_queue)
        self.routing = routing
        self._chains = {route.name: self._chain(route.chain) for route in routing.routes}
        return needs_restart

    def refusal(self, turn_type: str, model: str | None) -> AdmissionRefused | None:
        """The refusal a request would get now if every provider of its chain is full, else None:
        lets the sidecar answer 429 before it opens spans or reads the body further. The gates
        still decide for real when the request runs."""
        route = self.route_for(turn_type, model)
        gates = [self.gates[name] for name in route.chain]
        if not all(gate.full() for gate in gates):
            return None
        for gate in gates:
            gate.refused += 1
        return min((gate.refusal() for gate in gates), key=lambda r: r.retry_after or 0)

    async def chat(self, request: ChatRequest, ctx: CallContext | None = None) -> ChatResult:
        ctx = ctx or CallContext()
        result = await self.chain_for(ctx.turn_type, request.model).chat(request, ctx)
        if self.prompt_log is not None:  # kept once answered: a refused or failed request is no traffic
            self.prompt_log.record(request, ctx.turn_type)
        return result

    def stream(
        self, request: ChatRequest, ctx: CallContext | None = None
    ) -> AbstractAsyncContextManager[ChatStream]:
        """`async with runner.stream(request) as chunks: async for chunk in chunks: ...`; leaving the
        block stops the generation and frees the provider's slot."""
        ctx = ctx or CallContext()
        opened = self.chain_for(ctx.turn_type, request.model).stream(request, ctx)
        if self.prompt_log is None:
            return opened
        return _logged(opened, self.prompt_log, request, ctx)

    # ---- what the loop calls ----


    def turn(
        self, conversation_id: str | None = None, turn_type: str = "chat", agent: str | None = None
    ) -> Turn:
        return Turn(self, conversation_id, turn_type, agent)

    def sync(self) -> SyncRunner:
        return SyncRunner(self)

    async def aclose(self) -> None:
        if self._owns_policy_watch:
            getattr(self.policy, "stop_watching")()  # noqa: B009 (a PolicyStore's; the protocol lacks it)
        for provider in self.providers.values():
            try:
                await provider.aclose()
            except Exception:
                logger.exception("closing provider %s failed", provider.name)

    async def __aenter__(self) -> Runner:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


def _definition(config: ProviderConfig) -> dict[str, Any]:
    """A provider's config without its admission limits (those change live)."""
    return config.model_dump(exclude={"max_in_flight", "max_queue"})


def _limits_of(config: ProviderConfig | None) -> AdmissionLimits:
    return AdmissionLimits(
        max_in_flight=getattr(config, "max_in_flight", None), max_queue=getattr(config, "max_queue", None)
    )


def _check_pools(policy: str | Path | SpeculationPolicy | PolicySetting, providers: str | Path) -> None:
    """At load, the policy file's rules against the SGLang pools the routing file deploys
    (ConfigError naming each problem); a policy given as an object or switched off has no file."""
    if policy is PolicySetting.DEFAULT:
        from openalice_runner import defaults

        policy = defaults.path(defaults.POLICY)
    if not isinstance(policy, str | Path):
        return
    from openalice_runner.config_files import ConfigError
    from openalice_runner.pool_checks import check_pool_files

    problems = check_pool_files(policy, providers)
    if problems:
        raise ConfigError(problems)


def _policy_store(
    policy: str | Path | SpeculationPolicy | PolicySetting, watch: bool
) -> PolicyStore | SpeculationPolicy | None:
    if policy is PolicySetting.OFF:
        return None
    if policy is PolicySetting.DEFAULT:
        from openalice_runner import defaults

        policy = defaults.path(defaults.POLICY)
    if isinstance(policy, str | Path):
        from openalice_runner.policies import PolicyStore

        return PolicyStore.from_file(policy, watch=watch)
    if watch:
        getattr(policy, "start_watching")()  # noqa: B009 (a PolicyStore's; the protocol lacks it)
    return policy  # a PolicyStore (or anything with decide/observe)


def _response_format(value: ResponseFormatArg) -> dict[str, object]:
    """`response_format` as a ChatRequest field: a pydantic model class becomes its strict JSON schema."""
    if value is None:
        return {}
    from pydantic import BaseModel

    if isinstance(value, type) and issubclass(value, BaseModel):
        schema = {"name": value.__name__, "schema": value.model_json_schema(), "strict": True}
        value = {"type": "json_schema", "json_schema": schema}
    return {"response_format": value}


class Turn:
    """One turn of the agent: several model calls and tool steps, numbered in order (step 1, 2, ...).

    `attach_context`: make the turn span current inside `async with` (so the loop's own spans nest
    under it). SyncTurn turns it off: its calls run in different tasks, so parents are passed explicitly.
    """

    def __init__(
        self,
        runner: Runner,
        conversation_id: str | None,
        turn_type: str,
        agent: str | None,
        *,
        attach_context: bool = True,
    ) -> None:
        self.runner = runner
        self.conversation_id = conversation_id
        self.turn_type = turn_type
        self.agent = agent
        self.step = 0
        self._attach = attach_context
        self._span: Span | None = None
        self._otel_ctx: Context | None = None
        self._token: Token[Context] | None = None

    async def __aenter__(self) -> Turn:
        tel = self.runner.telemetry
        if tel is not None:
            from opentelemetry import context as otel_context
            from opentelemetry import trace

            self._span = tel.start_turn(self.agent, self.conversation_id, self.turn_type)
            self._otel_ctx = trace.set_span_in_context(self._span)
            if self._attach:
                self._token = otel_context.attach(self._otel_ctx)
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        tel = self.runner.telemetry
        if tel is None or self._span is None:
            return
        if self._token is not None:
            from opentelemetry import context as otel_context

            with contextlib.suppress(ValueError):  # exited in another context than entered
                otel_context.detach(self._token)
            self._token = None
        tel.end_turn(self._span, error=exc, steps=self.step)
        self._span = None

    def _next_ctx(self, turn_type: str | None, model: str | None) -> CallContext:
        self.step += 1
        attributes = {OTEL_CONTEXT_KEY: self._otel_ctx} if self._otel_ctx is not None else {}
        return CallContext(
            conversation_id=self.conversation_id,
            turn_type=turn_type or self.turn_type,
            step=self.step,
            agent=self.agent,
            model=model,
            attributes=attributes,
        )

    def _call(
        self,
        messages: MessagesArg,
        tools: ToolsArg,
        tool_choice: ToolChoiceArg,
        response_format: ResponseFormatArg,
        turn_type: str | None,
        model: str | None,
        sampling: dict[str, object],
    ) -> tuple[ChatRequest, CallContext]:
        """The request of one `chat` or `stream` call and its context (the turn's next step)."""
        sampling.update(_response_format(response_format))
        request = self._request(messages, tools, tool_choice, model, sampling)
        return request, self._next_ctx(turn_type, request.model)

    @staticmethod
    def _request(
        messages: MessagesArg, tools: ToolsArg, tool_choice: ToolChoiceArg, model: str | None,
        sampling: dict[str, object],
    ) -> ChatRequest:
        if isinstance(messages, ChatRequest):
            return messages
        fields = {"messages": coerce_messages(messages), "tools": tools, "tool_choice": tool_choice, "model": model}
        return ChatRequest.model_validate({**fields, **sampling})

    async def chat(
        self,
        messages: MessagesArg,
        *,
        tools: ToolsArg = None,
        tool_choice: ToolChoiceArg = None,
        response_format: ResponseFormatArg = None,
        turn_type: str | None = None,
        model: str | None = None,
        **sampling: object,
    ) -> ChatResult:
        """One model call. `messages`: dicts or ChatMessage (or a ready ChatRequest); `sampling`:
        temperature, top_p, top_k, seed, stop, max_tokens (and any other ChatRequest field, e.g.
        parallel_tool_calls). `response_format`: OpenAI's dict, or a pydantic model class (its JSON
        schema, strict); the embedded engine enforces it by grammar."""
        request, ctx = self._call(messages, tools, tool_choice, response_format, turn_type, model, sampling)
        return await self.runner.chat(request, ctx)

    def stream(
        self,
        messages: MessagesArg,
        *,
        tools: ToolsArg = None,
        tool_choice: ToolChoiceArg = None,
        response_format: ResponseFormatArg = None,
        turn_type: str | None = None,
        model: str | None = None,
        **sampling: object,
    ) -> AsyncGenerator[ChatChunk, None]:
        """One streamed model call; the last chunk carries finish_reason, usage and speculation.
        The generation stops when the iteration ends or fails, or when the generator is closed: to stop
        early, read it in `async with contextlib.aclosing(turn.stream(...))` (a bare `break` leaves the
        closing to the garbage collector); `runner.stream` gives the `async with` form directly."""
        request, ctx = self._call(messages, tools, tool_choice, response_format, turn_type, model, sampling)
        return _chunks_of(self.runner.stream(request, ctx))

    @contextlib.asynccontextmanager
    async def tool(
        self, name: str, call_id: str | None = None, arguments: object = None
    ) -> AsyncIterator[ToolStep]:
        """A tool step run by the loop: timed and traced as `execute_tool {name}`."""
        async with self._tool_step(name, call_id, arguments) as step:
            yield step

    @contextlib.asynccontextmanager
    async def _tool_step(self, name: str, call_id: str | None, arguments: object) -> AsyncIterator[ToolStep]:
        self.step += 1
        step = ToolStep(name, call_id, self.step)
        tel = self.runner.telemetry
        if tel is None:
            yield step
            return
        from opentelemetry import context as otel_context
        from opentelemetry import trace

        span = tel.start_tool(
            name, call_id, self.step, self.turn_type, parent=self._otel_ctx, arguments=arguments
        )
        token = otel_context.attach(trace.set_span_in_context(span)) if self._attach else None
        try:
            yield step
        except BaseException as exc:
            tel.end_tool(span, error=exc, result=step.result)
            raise
        else:
            tel.end_tool(span, result=step.result)
        finally:
            if token is not None:
                with contextlib.suppress(ValueError):
                    otel_context.detach(token)


@contextlib.asynccontextmanager
async def _logged(
    opened: AbstractAsyncContextManager[ChatStream], log: PromptLog, request: ChatRequest, ctx: CallContext
) -> AsyncIterator[ChatStream]:
    """The stream, with its prompt kept once it was read to its end (a stream left early, cut
    or failed is not kept: it produced no completion)."""
    ended = False

    async def through(chunks: ChatStream) -> AsyncGenerator[ChatChunk, None]:
        nonlocal ended
        async for chunk in chunks:
            yield chunk
        ended = True

    async with opened as chunks, chat_stream(through(chunks)) as logged:
        yield logged
    if ended:
        log.record(request, ctx.turn_type)


async def _chunks_of(opened: AbstractAsyncContextManager[ChatStream]) -> AsyncGenerator[ChatChunk, None]:
    """A stream's context as a plain async iterator: closing the generator leaves the context."""
    async with opened as chunks:
        async for chunk in chunks:
            yield chunk


class ToolStep:
    """Handle given inside `turn.tool(...)`: set `.result` to record the tool's output."""

    def __init__(self, name: str, call_id: str | None, step: int) -> None:
        self.name = name
        self.call_id = call_id
        self.step = step
        self.result: object = None  # what the tool returned (traced where content is recorded)


# ---------------------------------------------------------------- sync wrappers


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
